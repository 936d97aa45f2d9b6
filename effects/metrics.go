package effects

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem/internal/promreg"
)

// metrics are the Dispatcher's Prometheus collectors. Without a Registerer they
// exist but are registered nowhere, which keeps the code free of nil checks.
type metrics struct {
	pending                                       *prometheus.GaugeVec
	attempts, dead, unknown, lostLease, reconcile *prometheus.CounterVec
	lag                                           *prometheus.HistogramVec
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	f := promreg.With(reg)
	m := &metrics{
		pending:   f.Gauge("idem_effects_pending", "Effects waiting to be sent (state pending), by kind; refreshed periodically.", "kind"),
		attempts:  f.Counter("idem_effects_attempts_total", "Attempts at effects, by kind and outcome (done, retry, dead, reconciled, released).", "kind", "outcome"),
		dead:      f.Counter("idem_effects_dead_total", "Effects that became dead (permanent failure or attempts exhausted), by kind.", "kind"),
		lag:       f.Histogram("idem_effects_lag_seconds", "Time from an effect becoming due (its commit, or its retry time) to its Send call, by kind.", []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300}, "kind"),
		unknown:   f.Counter("idem_effects_unknown_total", "Attempts whose outcome was unknown (lease expired, or an indefinite error) and that Reconcile could not settle, by kind.", "kind"),
		lostLease: f.Counter("idem_effects_lost_lease_total", "Outcomes not recorded because the claim's lease had run out and the effect was claimed again (fence mismatch), by kind.", "kind"),
		reconcile: f.Counter("idem_effects_reconcile_total", "Reconcile calls, by kind and result (done, not_done, error).", "kind", "result"),
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
	promreg.Zero([]string{kind}, m.pending.MetricVec, m.dead.MetricVec, m.lag.MetricVec, m.unknown.MetricVec, m.lostLease.MetricVec)
	for _, o := range attemptOutcomes {
		m.attempts.WithLabelValues(kind, o)
	}
	for _, r := range reconcileResults {
		m.reconcile.WithLabelValues(kind, r)
	}
}
