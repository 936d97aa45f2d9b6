package httpidem

import (
	"maps"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem/internal/promreg"
)

// Outcomes: the outcome label of idem_http_requests_total.
const (
	// OutcomeCommitted: the handler's work and its final success response committed.
	OutcomeCommitted = "committed"
	// OutcomeFailed: a final client error (400, 422) was stored; the work rolled back.
	OutcomeFailed = "failed"
	// OutcomeReplayed: a stored response was sent again.
	OutcomeReplayed = "replayed"
	// OutcomeMismatch: the key came with a different request (422).
	OutcomeMismatch = "mismatch"
	// OutcomeInProgress: the key was busy past the wait (409).
	OutcomeInProgress = "in_progress"
	// OutcomeNotFinal: the handler answered a status that is not final (5xx, 409,
	// 429, …); its work rolled back and nothing was stored.
	OutcomeNotFinal = "not_final"
	// OutcomePanic: the handler panicked; its work rolled back.
	OutcomePanic = "panic"
	// OutcomeDisconnected: the client went away before the commit; rolled back.
	OutcomeDisconnected = "disconnected"
	// OutcomeTimeout: the request's deadline passed before the commit; rolled back.
	OutcomeTimeout = "timeout"
	// OutcomeRejected: the request was refused before anything ran (missing or
	// invalid key, tenant, body not JSON, body too large).
	OutcomeRejected = "rejected"
	// OutcomeError: the database or the configuration failed (5xx problem).
	OutcomeError = "error"
	// OutcomeUnkeyed: a request without a key on a route where the key is optional.
	OutcomeUnkeyed = "unkeyed"
	// OutcomeRecovered: Config.Lease.Recover settled a stale key without running the
	// handler.
	OutcomeRecovered = "recovered"
)

var allOutcomes = []string{OutcomeCommitted, OutcomeFailed, OutcomeReplayed, OutcomeMismatch, OutcomeInProgress,
	OutcomeNotFinal, OutcomePanic, OutcomeDisconnected, OutcomeTimeout, OutcomeRejected, OutcomeError,
	OutcomeUnkeyed, OutcomeRecovered}

// Stale-lease decisions: the decision label of idem_http_stale_leases_total.
var staleDecisions = []string{"rerun", "recovered", "error"}

// metrics are the middleware's Prometheus collectors. Middlewares on one registry
// share them; the operation label tells routes apart.
type metrics struct {
	requests  *prometheus.CounterVec
	replayAge *prometheus.HistogramVec
	lockWait  *prometheus.HistogramVec
	expired   *prometheus.CounterVec
	stale     *prometheus.CounterVec

	// ops are each operation's series, looked up once: a request finds its own
	// without hashing label values. Copied on write; operations are few.
	ops atomic.Pointer[map[string]*opMetrics]
	mu  sync.Mutex // serializes writers of ops
}

// opMetrics are one operation's series.
type opMetrics struct {
	requests            map[string]prometheus.Counter // by outcome
	stale               map[string]prometheus.Counter // by decision
	replayAge, lockWait prometheus.Observer
	expired             prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	f := promreg.With(reg)
	m := &metrics{
		requests:  f.Counter("idem_http_requests_total", "HTTP requests through the idempotency-key middleware, by operation and outcome.", "operation", "outcome"),
		replayAge: f.Histogram("idem_http_replay_age_seconds", "How long after the first answer a replay came; compare with the retention.", prometheus.ExponentialBuckets(0.01, 4, 14), "operation"),
		lockWait:  f.Histogram("idem_http_lock_wait_seconds", "Time to claim a key, including the wait for a concurrent request with the same key.", prometheus.ExponentialBuckets(0.0005, 4, 10), "operation"),
		expired:   f.Counter("idem_http_expired_keys_total", "Keys reused after their retention; the request ran as new.", "operation"),
		stale:     f.Counter("idem_http_stale_leases_total", "Lease-mode keys taken over after their lease ran out, by what Recover decided.", "operation", "decision"),
	}
	if err := f.Err(); err != nil {
		return nil, err
	}
	m.ops.Store(&map[string]*opMetrics{})
	return m, nil
}

// op returns an operation's series, creating every one of them at 0 the first
// time, so that dashboards and rate() see them before the first event.
func (m *metrics) op(op string) *opMetrics {
	if o, ok := (*m.ops.Load())[op]; ok {
		return o
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	cur := *m.ops.Load()
	if o, ok := cur[op]; ok {
		return o
	}
	o := &opMetrics{requests: map[string]prometheus.Counter{}, stale: map[string]prometheus.Counter{},
		replayAge: m.replayAge.WithLabelValues(op), lockWait: m.lockWait.WithLabelValues(op),
		expired: m.expired.WithLabelValues(op)}
	for _, out := range allOutcomes {
		o.requests[out] = m.requests.WithLabelValues(op, out)
	}
	for _, d := range staleDecisions {
		o.stale[d] = m.stale.WithLabelValues(op, d)
	}
	next := maps.Clone(cur)
	next[op] = o
	m.ops.Store(&next)
	return o
}
