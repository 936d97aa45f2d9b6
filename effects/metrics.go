package effects

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem/internal/promreg"
)

// metrics are the Dispatcher's Prometheus collectors. Without a Registerer they
// exist but are registered nowhere, which keeps the code free of nil checks.
type metrics struct {
	pending   *prometheus.GaugeVec
	attempts  *prometheus.CounterVec
	dead      *prometheus.CounterVec
	lag       *prometheus.HistogramVec
	unknown   *prometheus.CounterVec
	lostLease *prometheus.CounterVec
	reconcile *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	f := promreg.With(reg)
	m := &metrics{
		pending: f.GaugeVec(prometheus.GaugeOpts{
			Name: "idem_effects_pending",
			Help: "Effects waiting to be sent (state pending), by kind; refreshed periodically.",
		}, "kind"),
		attempts: f.CounterVec(prometheus.CounterOpts{
			Name: "idem_effects_attempts_total",
			Help: "Attempts at effects, by kind and outcome (done, retry, dead, reconciled, released).",
		}, "kind", "outcome"),
		dead: f.CounterVec(prometheus.CounterOpts{
			Name: "idem_effects_dead_total",
			Help: "Effects that became dead (permanent failure or attempts exhausted), by kind.",
		}, "kind"),
		lag: f.HistogramVec(prometheus.HistogramOpts{
			Name:    "idem_effects_lag_seconds",
			Help:    "Time from an effect becoming due (its commit, or its retry time) to its Send call, by kind.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300},
		}, "kind"),
		unknown: f.CounterVec(prometheus.CounterOpts{
			Name: "idem_effects_unknown_total",
			Help: "Attempts whose outcome was unknown (lease expired, or an indefinite error) and that Reconcile could not settle, by kind.",
		}, "kind"),
		lostLease: f.CounterVec(prometheus.CounterOpts{
			Name: "idem_effects_lost_lease_total",
			Help: "Outcomes not recorded because the claim's lease had run out and the effect was claimed again (fence mismatch), by kind.",
		}, "kind"),
		reconcile: f.CounterVec(prometheus.CounterOpts{
			Name: "idem_effects_reconcile_total",
			Help: "Reconcile calls, by kind and result (done, not_done, error).",
		}, "kind", "result"),
	}
	return m, f.Err()
}

// Label values that a dashboard expects for every kind, created at 0 up front.
var (
	attemptOutcomes  = []string{"done", "retry", "dead", "reconciled", "released"}
	reconcileResults = []string{"done", "not_done", "error"}
)

// precreate makes every series of kind exist at 0, so that a dashboard or an alert
// (rate(idem_effects_dead_total[5m]) > 0) sees the kind before its first event
// instead of no data.
func (m *metrics) precreate(kind string) {
	m.pending.WithLabelValues(kind)
	for _, o := range attemptOutcomes {
		m.attempts.WithLabelValues(kind, o)
	}
	m.dead.WithLabelValues(kind)
	m.lag.WithLabelValues(kind)
	m.unknown.WithLabelValues(kind)
	m.lostLease.WithLabelValues(kind)
	for _, r := range reconcileResults {
		m.reconcile.WithLabelValues(kind, r)
	}
}
