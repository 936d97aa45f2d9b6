package effects_test

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/pgtest"
)

// TestDispatcherMetricsExistFromStart: a scrape right after NewDispatcher, before
// any work, already has every series of each configured kind, at 0, so that a
// dashboard shows the kind and rate() or increase() alerts work from the first
// event. (Before, each series appeared at its first increment.)
func TestDispatcherMetricsExistFromStart(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	reg := prometheus.NewRegistry()
	noop := effects.SenderFunc(func(context.Context, effects.Delivery) error { return nil })
	_, err := effects.NewDispatcher(effects.Config{Pool: pool, Schema: schema, Registerer: reg,
		Senders: map[string]effects.Sender{"mail": noop, "publish:orders": noop}})
	require.NoError(t, err)

	series := scrape(t, reg)
	for _, kind := range []string{"mail", "publish:orders"} {
		for _, want := range []string{
			"idem_effects_pending{kind=" + kind + "}",
			"idem_effects_dead_total{kind=" + kind + "}",
			"idem_effects_unknown_total{kind=" + kind + "}",
			"idem_effects_lost_lease_total{kind=" + kind + "}",
			"idem_effects_lag_seconds{kind=" + kind + "}",
			"idem_effects_attempts_total{kind=" + kind + ",outcome=done}",
			"idem_effects_attempts_total{kind=" + kind + ",outcome=retry}",
			"idem_effects_attempts_total{kind=" + kind + ",outcome=dead}",
			"idem_effects_attempts_total{kind=" + kind + ",outcome=reconciled}",
			"idem_effects_attempts_total{kind=" + kind + ",outcome=released}",
			"idem_effects_reconcile_total{kind=" + kind + ",result=done}",
			"idem_effects_reconcile_total{kind=" + kind + ",result=not_done}",
			"idem_effects_reconcile_total{kind=" + kind + ",result=error}",
		} {
			v, ok := series[want]
			require.True(t, ok, "series %s missing before any work; have %v", want, series)
			require.Zero(t, v, want)
		}
	}
}

// scrape gathers reg into "name{label=value,…}" → value (a histogram's count).
func scrape(t testing.TB, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	out := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.Metric {
			name := mf.GetName() + "{"
			for i, l := range m.Label {
				if i > 0 {
					name += ","
				}
				name += l.GetName() + "=" + l.GetValue()
			}
			name += "}"
			switch {
			case m.Counter != nil:
				out[name] = m.GetCounter().GetValue()
			case m.Gauge != nil:
				out[name] = m.GetGauge().GetValue()
			case m.Histogram != nil:
				out[name] = float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return out
}

// TestDispatcherPendingGaugeFallsToZero: idem_effects_pending of a kind this
// dispatcher has no sender for goes to 0 once that kind has nothing pending, instead
// of keeping its last count. (Before, it showed 5 pending long after all were sent.)
func TestDispatcherPendingGaugeFallsToZero(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	reg := prometheus.NewRegistry()
	enqueueMany(t, pool, "elsewhere", "e", 5)
	cfg := fastConfig(pool, schema, map[string]effects.Sender{"mine": newRecorder(nil)})
	cfg.Registerer = reg
	cfg.PendingRefresh = 50 * time.Millisecond
	start(t, cfg)
	pgtest.WaitFor(t, 30*time.Second, "pending 5", func() bool { return metricValue(t, reg, "idem_effects_pending", "elsewhere") == 5 })
	// Another dispatcher sends them.
	_, err := pool.Exec(context.Background(), `UPDATE effects SET state = 'done', done_at = now() WHERE kind = 'elsewhere'`)
	require.NoError(t, err)
	pgtest.WaitFor(t, 30*time.Second, "pending 0", func() bool { return metricValue(t, reg, "idem_effects_pending", "elsewhere") == 0 })
	require.Zero(t, metricValue(t, reg, "idem_effects_pending", "mine"))
}

// logCapture is a slog handler that keeps the records it gets.
type logCapture struct {
	mu      sync.Mutex
	records []slog.Record
}

func (h *logCapture) Enabled(context.Context, slog.Level) bool { return true }
func (h *logCapture) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.records = append(h.records, r.Clone())
	return nil
}
func (h *logCapture) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *logCapture) WithGroup(string) slog.Handler      { return h }

// errors returns the Error records so far, each as its message and attributes.
func (h *logCapture) errors() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []string
	for _, r := range h.records {
		if r.Level < slog.LevelError {
			continue
		}
		msg := r.Message
		r.Attrs(func(a slog.Attr) bool { msg += " " + a.String(); return true })
		out = append(out, msg)
	}
	return out
}

// retryWaits returns the retry_in of every "LISTEN connection lost" record so far.
func (h *logCapture) retryWaits() []time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []time.Duration
	for _, r := range h.records {
		if r.Message != "effects dispatcher: LISTEN connection lost; polling until it is back" {
			continue
		}
		r.Attrs(func(a slog.Attr) bool {
			if a.Key == "retry_in" {
				out = append(out, a.Value.Duration())
			}
			return true
		})
	}
	return out
}

// TestListenBackoffResetsAfterReconnect: each cut of a LISTEN connection that was
// working is followed by the shortest wait, however many cuts came before, so an
// effect enqueued right after a cut is not left waiting for a long backoff. (Before,
// the wait doubled on every cut and stayed at 5 s: an effect committed right after
// the sixth cut waited 5 s for its wake-up.) Every other cut is an outage that
// also refuses the first reconnects, each of which logs a longer wait: the test
// counts shortest waits, never log lines.
func TestListenBackoffResetsAfterReconnect(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	logs := &logCapture{}
	rec := newRecorder(nil)
	cfg := fastConfig(pool, schema, map[string]effects.Sender{"n": rec})
	cfg.PollInterval = time.Hour // only LISTEN/NOTIFY wakes it
	cfg.Logger = slog.New(logs)
	proxy := pgtest.NewProxy(t, 0)
	cfg.ListenConnConfig = proxy.Config(t, schema, pgtest.Options{}).ConnConfig
	start(t, cfg)
	admin := pgtest.NewPool(t, "public", 1)
	const cuts = 7
	var gone []int32
	for i := range cuts {
		// Cut only a connection that got as far as LISTEN (idle after it), and
		// each one once.
		pgtest.WaitFor(t, 30*time.Second, "LISTEN connection up", func() bool {
			if i%2 == 1 {
				pid := listener(t, admin, schema, gone...)
				if pid != 0 {
					gone = append(gone, pid)
					proxy.Outage(time.Second) // the reconnects of the next second are refused
				}
				return pid != 0
			}
			pid := cutListener(t, admin, schema, gone...)
			if pid != 0 {
				gone = append(gone, pid)
			}
			return pid != 0
		})
	}
	// The Dispatcher logs a lost connection before it reconnects, so once it
	// listens again every cut has been logged.
	pgtest.WaitFor(t, 30*time.Second, "LISTEN connection up again", func() bool { return listenerUp(t, admin, schema, gone...) })
	require.Positive(t, proxy.Refused(), "a reconnect failed")
	waits := logs.retryWaits()
	shortest := 0
	for _, w := range waits {
		if w == 100*time.Millisecond {
			shortest++
		}
	}
	require.GreaterOrEqual(t, shortest, cuts, "a shortest wait after each of the %d cuts of a working connection: %v", cuts, waits)
	require.Greater(t, len(waits), cuts, "reconnects that failed logged too")
	// And the dispatcher is woken again after the last cut.
	enqueue(t, pool, schema, effects.Effect{Kind: "n", Key: "after-cuts"})
	waitState(t, pool, "n", "after-cuts", "done", 30*time.Second)
}

// listenerQuery finds the LISTEN connection idle after LISTEN for 300 ms: the
// server shows LISTEN done before the client has read its answer, and a cut in
// between is, to the Dispatcher, a connection that never listened (its backoff
// rightly goes on growing). 300 ms idle leaves the client time to read it.
const listenerQuery = `FROM pg_stat_activity WHERE application_name = $1 AND query = 'LISTEN idem_effects' AND state = 'idle'
	AND state_change < now() - interval '300 milliseconds'`

// listener is the pid of the dispatcher's LISTEN connection once it got as far as
// LISTEN (idle after it), or 0. A backend terminated a moment ago can still be
// listed, so pids in gone are not counted.
func listener(t testing.TB, admin *pgxpool.Pool, schema string, gone ...int32) int32 {
	t.Helper()
	var pid int32
	err := admin.QueryRow(context.Background(), `SELECT coalesce(max(pid), 0) `+listenerQuery+` AND pid <> ALL(coalesce($2::int4[], '{}'))`,
		"idem-test:"+schema, gone).Scan(&pid)
	require.NoError(t, err)
	return pid
}

func listenerUp(t testing.TB, admin *pgxpool.Pool, schema string, gone ...int32) bool {
	return listener(t, admin, schema, gone...) != 0
}

// cutListener terminates the dispatcher's LISTEN connection, if it is up and not
// in gone, and returns its pid (0: none was up).
func cutListener(t testing.TB, admin *pgxpool.Pool, schema string, gone ...int32) int32 {
	t.Helper()
	var pid int32
	err := admin.QueryRow(context.Background(), `SELECT coalesce(max(pid) FILTER (WHERE pg_terminate_backend(pid)), 0) `+
		listenerQuery+` AND pid <> ALL(coalesce($2::int4[], '{}'))`, "idem-test:"+schema, gone).Scan(&pid)
	require.NoError(t, err)
	return pid
}

// waitListenerGone waits until the dispatcher's LISTEN connection is closed: its
// Run's context has ended.
func waitListenerGone(t testing.TB, admin *pgxpool.Pool, schema string) {
	t.Helper()
	pgtest.WaitFor(t, 30*time.Second, "Run's context ended", func() bool {
		return pgtest.Count(t, admin, `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = $1 AND query = 'LISTEN idem_effects'`, "idem-test:"+schema) == 0
	})
}

// ListenConnConfig sends the LISTEN connection where it says (here: the same
// Postgres under another application_name, as a direct connection beside a pooler
// would be), and notifications arriving there wake the Dispatcher.
func TestDispatcherListenConnConfig(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	rec := newRecorder(nil)
	cfg := fastConfig(pool, schema, map[string]effects.Sender{"n": rec})
	cfg.PollInterval = time.Hour // only the LISTEN connection wakes it
	listen := pool.Config().ConnConfig.Copy()
	listen.RuntimeParams["application_name"] = "idem-test-listen:" + schema
	cfg.ListenConnConfig = listen
	start(t, cfg)
	admin := pgtest.NewPool(t, "public", 1)
	pgtest.WaitFor(t, 30*time.Second, "LISTEN on the configured connection", func() bool {
		return pgtest.Count(t, admin, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query = 'LISTEN idem_effects'`,
			"idem-test-listen:"+schema) == 1
	})
	require.False(t, listenerUp(t, admin, schema), "no LISTEN on the pool's config")
	enqueue(t, pool, schema, effects.Effect{Kind: "n", Key: "woken"})
	waitState(t, pool, "n", "woken", "done", 30*time.Second)
}
