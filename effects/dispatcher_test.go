package effects_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/pgtest"
)

// recorder is a Sender that counts the attempts at each key.
type recorder struct {
	mu    sync.Mutex
	sends map[string][]effects.Delivery
	fn    func(ctx context.Context, d effects.Delivery) error
}

func newRecorder(fn func(ctx context.Context, d effects.Delivery) error) *recorder {
	return &recorder{sends: map[string][]effects.Delivery{}, fn: fn}
}

func (r *recorder) Send(ctx context.Context, d effects.Delivery) error {
	r.mu.Lock()
	r.sends[d.Key] = append(r.sends[d.Key], d)
	r.mu.Unlock()
	if r.fn != nil {
		return r.fn(ctx, d)
	}
	return nil
}

func (r *recorder) count(key string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.sends[key])
}

func (r *recorder) attempts(key string) []int {
	r.mu.Lock()
	defer r.mu.Unlock()
	var a []int
	for _, d := range r.sends[key] {
		a = append(a, d.Attempt)
	}
	return a
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	noop := effects.SenderFunc(func(context.Context, effects.Delivery) error { return nil })
	for name, cfg := range map[string]effects.Config{
		"no pool":        {Senders: map[string]effects.Sender{"a": noop}},
		"no senders":     {Pool: pool},
		"bad kind":       {Pool: pool, Senders: map[string]effects.Sender{"bad kind": noop}},
		"bad schema":     {Pool: pool, Schema: "Bad-Schema", Senders: map[string]effects.Sender{"a": noop}},
		"nil sender":     {Pool: pool, Senders: map[string]effects.Sender{"a": nil}},
		"orphan conc":    {Pool: pool, Senders: map[string]effects.Sender{"a": noop}, Concurrency: map[string]int{"b": 1}},
		"bad backoff":    {Pool: pool, Senders: map[string]effects.Sender{"a": noop}, Backoff: effects.Backoff{Initial: time.Hour, Max: time.Second}},
		"negative batch": {Pool: pool, Senders: map[string]effects.Sender{"a": noop}, BatchSize: -1},
	} {
		_, err := effects.NewDispatcher(cfg)
		require.ErrorContains(t, err, "invalid config: ", name)
	}
	_, err := effects.NewDispatcher(effects.Config{Pool: pool, Schema: schema, Senders: map[string]effects.Sender{"a": noop}})
	require.NoError(t, err)
}

func TestBackoffDelay(t *testing.T) {
	t.Parallel()
	b := effects.Backoff{Initial: time.Second, Max: 10 * time.Second, Multiplier: 2, Jitter: 0}
	for n, want := range map[int]time.Duration{1: time.Second, 2: 2 * time.Second, 3: 4 * time.Second, 4: 8 * time.Second, 5: 10 * time.Second, 50: 10 * time.Second} {
		require.Equal(t, want, b.Delay(n), "attempt %d", n)
	}
	b.Jitter = 0.2
	for range 100 {
		d := b.Delay(2)
		require.GreaterOrEqual(t, d, 1600*time.Millisecond)
		require.LessOrEqual(t, d, 2400*time.Millisecond)
	}
}

func TestDispatcherSendsEffects(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	reg := prometheus.NewRegistry()
	rec := newRecorder(nil)
	cfg := fastConfig(pool, schema, map[string]effects.Sender{"mail": rec})
	cfg.Registerer = reg
	start(t, cfg)
	enqueue(t, pool, schema,
		effects.Effect{Kind: "mail", Key: "receipt:1", Payload: []byte(`{"to":"a@example.com"}`)},
		effects.Effect{Kind: "mail", Key: "receipt:2", Payload: []byte(`{"to":"b@example.com"}`)},
		effects.Effect{Kind: "orphan", Key: "nobody-sends-me"},
	)
	waitState(t, pool, "mail", "receipt:1", "done", 30*time.Second)
	waitState(t, pool, "mail", "receipt:2", "done", 30*time.Second)
	require.Equal(t, 1, rec.count("receipt:1"))
	d := rec.sends["receipt:1"][0]
	require.Equal(t, "mail", d.Kind)
	require.Equal(t, 1, d.Attempt)
	require.JSONEq(t, `{"to":"a@example.com"}`, string(d.Payload))
	require.WithinDuration(t, time.Now(), d.CreatedAt, time.Minute)

	// A kind without a sender is left alone, not failed.
	orphan := getEffect(t, pool, "orphan", "nobody-sends-me")
	require.Equal(t, "pending", orphan.State)
	require.Equal(t, 0, orphan.Attempts)

	pgtest.WaitFor(t, 30*time.Second, "attempts metric", func() bool {
		return metricValue(t, reg, "idem_effects_attempts_total", "mail", "done") == 2
	})
}

// metricValue reads a counter or gauge of the registry by its label values (0 if
// it has not been set).
func metricValue(t testing.TB, reg *prometheus.Registry, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.Metric {
			match := len(m.Label) == len(labels)
			for i, l := range m.Label {
				if match && l.GetValue() != labels[i] {
					match = false
				}
			}
			if match {
				if m.Counter != nil {
					return m.GetCounter().GetValue()
				}
				return m.GetGauge().GetValue()
			}
		}
	}
	return 0
}

func TestDispatcherTransientFailuresThenSuccess(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	rec := newRecorder(func(_ context.Context, d effects.Delivery) error {
		if d.Attempt <= 3 {
			return fmt.Errorf("provider unavailable (attempt %d)", d.Attempt)
		}
		return nil
	})
	start(t, fastConfig(pool, schema, map[string]effects.Sender{"webhook": rec}))
	enqueue(t, pool, schema, effects.Effect{Kind: "webhook", Key: "wh:1"})
	r := waitState(t, pool, "webhook", "wh:1", "done", 30*time.Second)
	require.Equal(t, 4, r.Attempts)
	require.Equal(t, []int{1, 2, 3, 4}, rec.attempts("wh:1"))
	require.Contains(t, r.LastError, "attempt 3")
	require.False(t, r.InFlight)
	for _, d := range rec.sends["wh:1"] {
		require.Equal(t, "wh:1", d.Key, "every attempt carries the same key")
	}
}

func TestDispatcherBackoffWaits(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	rec := newRecorder(func(context.Context, effects.Delivery) error { return errors.New("nope") })
	cfg := fastConfig(pool, schema, map[string]effects.Sender{"slowretry": rec})
	cfg.Backoff = effects.Backoff{Initial: time.Hour, Max: time.Hour, Jitter: -1}
	start(t, cfg)
	enqueue(t, pool, schema, effects.Effect{Kind: "slowretry", Key: "k"})
	pgtest.WaitFor(t, 30*time.Second, "a failed attempt", func() bool { return getEffect(t, pool, "slowretry", "k").LastError != "" })
	r := getEffect(t, pool, "slowretry", "k")
	require.Equal(t, "pending", r.State)
	require.InDelta(t, time.Hour.Seconds(), r.DueIn.Seconds(), 60, "next attempt an hour away, by the database's clock")
	time.Sleep(200 * time.Millisecond)
	require.Equal(t, 1, rec.count("k"))
}

func TestDispatcherPermanentThenRequeue(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	reg := prometheus.NewRegistry()
	var fail atomic.Bool
	fail.Store(true)
	rec := newRecorder(func(context.Context, effects.Delivery) error {
		if fail.Load() {
			return effects.Permanent(errors.New("mailbox does not exist"))
		}
		return nil
	})
	cfg := fastConfig(pool, schema, map[string]effects.Sender{"mail": rec})
	cfg.Registerer = reg
	start(t, cfg)
	enqueue(t, pool, schema, effects.Effect{Kind: "mail", Key: "m:1"})
	r := waitState(t, pool, "mail", "m:1", "dead", 30*time.Second)
	require.Equal(t, 1, r.Attempts, "a permanent failure is not retried")
	require.Contains(t, r.LastError, "mailbox does not exist")
	pgtest.WaitFor(t, 30*time.Second, "dead metric", func() bool { return metricValue(t, reg, "idem_effects_dead_total", "mail") == 1 })

	fail.Store(false)
	n, err := effectsdb.RequeueDead(context.Background(), pool, schema, effectsdb.RequeueFilter{Kind: "mail", Key: "m:1"})
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	r = waitState(t, pool, "mail", "m:1", "done", 30*time.Second)
	require.Equal(t, 1, r.Attempts, "attempts start again after a requeue")
	require.Equal(t, 2, rec.count("m:1"))
}

func TestDispatcherMaxAttempts(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	rec := newRecorder(func(context.Context, effects.Delivery) error { return errors.New("timeout") })
	start(t, fastConfig(pool, schema, map[string]effects.Sender{"sms": rec}))
	enqueue(t, pool, schema, effects.Effect{Kind: "sms", Key: "s:1", MaxAttempts: 3})
	r := waitState(t, pool, "sms", "s:1", "dead", 30*time.Second)
	require.Equal(t, 3, r.Attempts)
	require.Contains(t, r.LastError, "max attempts (3) reached: timeout")
	require.Equal(t, 3, rec.count("s:1"))
}

func TestDispatcherPanickingSender(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	rec := newRecorder(func(_ context.Context, d effects.Delivery) error {
		if d.Key == "boom" && d.Attempt == 1 {
			panic("sender bug")
		}
		return nil
	})
	start(t, fastConfig(pool, schema, map[string]effects.Sender{"p": rec}))
	enqueue(t, pool, schema, effects.Effect{Kind: "p", Key: "boom"}, effects.Effect{Kind: "p", Key: "fine"})
	r := waitState(t, pool, "p", "boom", "done", 30*time.Second)
	require.Equal(t, 2, r.Attempts)
	require.Contains(t, r.LastError, "sender panicked: sender bug")
	waitState(t, pool, "p", "fine", "done", 30*time.Second)
}

func TestRequeueDeadFilters(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	ctx := context.Background()
	enqueueMany(t, pool, "a", "a", 3)
	enqueueMany(t, pool, "b", "b", 2)
	enqueueMany(t, pool, "c", "c", 1)
	_, err := pool.Exec(ctx, `UPDATE effects SET state = 'dead', attempts = 25, last_error = 'x'`)
	require.NoError(t, err)

	_, err = effectsdb.RequeueDead(ctx, pool, schema, effectsdb.RequeueFilter{})
	require.Error(t, err, "an empty filter is refused")

	n, err := effectsdb.RequeueDead(ctx, pool, schema, effectsdb.RequeueFilter{Key: "b1"})
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	n, err = effectsdb.RequeueDead(ctx, pool, schema, effectsdb.RequeueFilter{Kind: "a"})
	require.NoError(t, err)
	require.EqualValues(t, 3, n)
	require.Equal(t, 2, countState(t, pool, "dead"))
	n, err = effectsdb.RequeueDead(ctx, pool, schema, effectsdb.RequeueFilter{All: true})
	require.NoError(t, err)
	require.EqualValues(t, 2, n)
	require.Equal(t, 6, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE state = 'pending' AND attempts = 0 AND next_attempt_at <= now()`))

	_, err = effectsdb.RequeueDead(ctx, pool, "no_such_schema", effectsdb.RequeueFilter{All: true})
	require.ErrorIs(t, err, effects.ErrSchemaMissing)
}

func TestTwoDispatchersNeverSendTheSameEffectAtOnce(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	const n = 1000
	var active sync.Map
	var total atomic.Int64
	counts := make([]atomic.Int32, n)
	sender := effects.SenderFunc(func(_ context.Context, d effects.Delivery) error {
		if _, busy := active.LoadOrStore(d.Key, true); busy {
			t.Errorf("key %s sent by two dispatchers at once", d.Key)
		}
		var i int
		if _, err := fmt.Sscanf(d.Key, "k%d", &i); err != nil {
			return err
		}
		counts[i].Add(1)
		time.Sleep(time.Duration(rand.IntN(500)) * time.Microsecond)
		active.Delete(d.Key)
		total.Add(1)
		return nil
	})
	pool2 := pgtest.NewPool(t, schema, 4)
	for _, p := range []*pgxpool.Pool{pool, pool2} {
		cfg := fastConfig(p, schema, map[string]effects.Sender{"k": sender})
		cfg.BatchSize = 20
		start(t, cfg)
	}
	enqueueMany(t, pool, "k", "k", n)
	pgtest.WaitFor(t, 30*time.Second, "every effect done", func() bool { return countState(t, pool, "done") == n })
	for i := range counts {
		require.EqualValues(t, 1, counts[i].Load(), "key k%d", i)
	}
	require.EqualValues(t, n, total.Load())
}

// TestDispatcherShutdownReleasesClaims: claims not yet started when Run's context
// ends are given back at once, with their attempt returned.
func TestDispatcherShutdownReleasesClaims(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	started := make(chan string, 10)
	unblock := make(chan struct{})
	rec := newRecorder(func(_ context.Context, d effects.Delivery) error {
		started <- d.Key
		<-unblock
		return nil
	})
	cfg := fastConfig(pool, schema, map[string]effects.Sender{"slow": rec})
	cfg.Concurrency = map[string]int{"slow": 1} // one sending, one waiting
	cfg.Lease = time.Hour
	enqueueMany(t, pool, "slow", "s", 5)
	stop := start(t, cfg)
	first := <-started
	pgtest.WaitFor(t, 30*time.Second, "two claims", func() bool {
		return pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE in_flight`) == 2
	})
	pgtest.WaitFor(t, 30*time.Second, "LISTEN connection up", func() bool { return listenerUp(t, pool, schema) })
	stopped := make(chan struct{})
	go func() { stop(); close(stopped) }()
	// Only once Run's context has ended may the send in flight finish (within the
	// shutdown timeout), so that the waiting claim is released, not sent.
	waitListenerGone(t, pool, schema)
	close(unblock)
	<-stopped

	require.Equal(t, "done", getEffect(t, pool, "slow", first).State, "the send in flight finished and was recorded")
	require.Equal(t, 1, countState(t, pool, "done"))
	require.Equal(t, 0, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE in_flight`), "no claim is left held")
	require.Equal(t, 4, pgtest.Count(t, pool, `SELECT count(*) FROM effects
		WHERE state = 'pending' AND attempts = 0 AND next_attempt_at <= now()`), "released claims are due now, attempt returned")
	require.Equal(t, 1, rec.count(first))
}

// TestDispatcherShutdownCancelsStuckSends: past the shutdown timeout a send is
// cancelled, and its outcome is recorded as unknown, due now, so the next claim
// reconciles before sending again.
func TestDispatcherShutdownCancelsStuckSends(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	started := make(chan struct{}, 1)
	sender := &reconcilingSender{send: func(ctx context.Context, d effects.Delivery) error {
		started <- struct{}{}
		<-ctx.Done()
		return ctx.Err()
	}}
	cfg := fastConfig(pool, schema, map[string]effects.Sender{"stuck": sender})
	cfg.ShutdownTimeout = 100 * time.Millisecond
	cfg.Lease = time.Hour
	enqueue(t, pool, schema, effects.Effect{Kind: "stuck", Key: "k"})
	stop := start(t, cfg)
	<-started
	stop()
	r := getEffect(t, pool, "stuck", "k")
	require.Equal(t, "pending", r.State)
	require.True(t, r.InFlight, "the outcome is unknown")
	require.LessOrEqual(t, r.DueIn, time.Duration(0), "due now")
	require.Contains(t, r.LastError, "context canceled")

	// The next dispatcher asks the Reconciler first; it says the send happened.
	sender2 := &reconcilingSender{reconcile: func(context.Context, effects.Delivery) (bool, error) { return true, nil }}
	start(t, fastConfig(pool, schema, map[string]effects.Sender{"stuck": sender2}))
	waitState(t, pool, "stuck", "k", "done", 30*time.Second)
	require.EqualValues(t, 1, sender2.reconciles.Load())
	require.EqualValues(t, 0, sender2.sends.Load())
}

type reconcilingSender struct {
	send       func(context.Context, effects.Delivery) error
	reconcile  func(context.Context, effects.Delivery) (bool, error)
	sends      atomic.Int64
	reconciles atomic.Int64
}

func (s *reconcilingSender) Send(ctx context.Context, d effects.Delivery) error {
	s.sends.Add(1)
	if s.send != nil {
		return s.send(ctx, d)
	}
	return nil
}

func (s *reconcilingSender) Reconcile(ctx context.Context, d effects.Delivery) (bool, error) {
	s.reconciles.Add(1)
	if s.reconcile != nil {
		return s.reconcile(ctx, d)
	}
	return false, nil
}

// simulateExpiredClaim makes an effect look like a claim whose process died
// mid-send: in_flight, one attempt used, due now.
func simulateExpiredClaim(t testing.TB, pool *pgxpool.Pool, kind, key string) {
	t.Helper()
	_, err := pool.Exec(context.Background(), `UPDATE effects SET in_flight = true, attempts = 1, fence = 1,
		next_attempt_at = now() - interval '1 second' WHERE kind = $1 AND key = $2`, kind, key)
	require.NoError(t, err)
}

func TestDispatcherReconcile(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	reg := prometheus.NewRegistry()
	var flaky atomic.Int32
	sender := &reconcilingSender{reconcile: func(_ context.Context, d effects.Delivery) (bool, error) {
		switch d.Key {
		case "happened":
			return true, nil
		case "did-not-happen":
			return false, nil
		default: // "unknown-once": the provider's query API fails once
			if flaky.Add(1) == 1 {
				return false, errors.New("provider query API down")
			}
			return false, nil
		}
	}}
	for _, k := range []string{"happened", "did-not-happen", "unknown-once", "fresh"} {
		enqueue(t, pool, schema, effects.Effect{Kind: "pay", Key: k})
		if k != "fresh" {
			simulateExpiredClaim(t, pool, "pay", k)
		}
	}
	cfg := fastConfig(pool, schema, map[string]effects.Sender{"pay": sender})
	cfg.Registerer = reg
	start(t, cfg)
	for _, k := range []string{"happened", "did-not-happen", "unknown-once", "fresh"} {
		waitState(t, pool, "pay", k, "done", 30*time.Second)
	}
	require.EqualValues(t, 1+1+2, sender.reconciles.Load(), "a fresh effect is not reconciled")
	require.EqualValues(t, 3, sender.sends.Load(), "the effect that happened is not sent again")
	require.Equal(t, 2, getEffect(t, pool, "pay", "happened").Attempts)
	require.Equal(t, 3, getEffect(t, pool, "pay", "unknown-once").Attempts)
	require.Contains(t, getEffect(t, pool, "pay", "unknown-once").LastError, "provider query API down")
	pgtest.WaitFor(t, 30*time.Second, "metrics", func() bool {
		return metricValue(t, reg, "idem_effects_unknown_total", "pay") == 1 &&
			metricValue(t, reg, "idem_effects_attempts_total", "pay", "reconciled") == 1
	})
}

// TestDispatcherIndefiniteErrorReconciles: an Indefinite error keeps the outcome
// unknown, and the retry asks the Reconciler first.
func TestDispatcherIndefiniteErrorReconciles(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	sender := &reconcilingSender{
		send: func(context.Context, effects.Delivery) error {
			return effects.Indefinite(errors.New("read timeout after the request was written"))
		},
		reconcile: func(context.Context, effects.Delivery) (bool, error) { return true, nil },
	}
	start(t, fastConfig(pool, schema, map[string]effects.Sender{"pay": sender}))
	enqueue(t, pool, schema, effects.Effect{Kind: "pay", Key: "p1"})
	r := waitState(t, pool, "pay", "p1", "done", 30*time.Second)
	require.EqualValues(t, 1, sender.sends.Load())
	require.EqualValues(t, 1, sender.reconciles.Load())
	require.Equal(t, 2, r.Attempts)
	require.False(t, r.InFlight)
}

// TestDispatcherNoReconcilerResends: without a Reconciler, an effect whose outcome
// is unknown is sent again with the same key, and counted as unknown.
func TestDispatcherNoReconcilerResends(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	reg := prometheus.NewRegistry()
	rec := newRecorder(nil)
	enqueue(t, pool, schema, effects.Effect{Kind: "mail", Key: "m"})
	simulateExpiredClaim(t, pool, "mail", "m")
	cfg := fastConfig(pool, schema, map[string]effects.Sender{"mail": rec})
	cfg.Registerer = reg
	start(t, cfg)
	waitState(t, pool, "mail", "m", "done", 30*time.Second)
	require.Equal(t, []int{2}, rec.attempts("m"))
	pgtest.WaitFor(t, 30*time.Second, "unknown metric", func() bool { return metricValue(t, reg, "idem_effects_unknown_total", "mail") == 1 })
}

// TestDispatcherLostLease: a sender that overruns its lease (ignoring ctx) cannot
// record over the attempt that took the effect over; the lost lease is counted.
func TestDispatcherLostLease(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	reg := prometheus.NewRegistry()
	var calls atomic.Int32
	slowFirst := effects.SenderFunc(func(context.Context, effects.Delivery) error {
		if calls.Add(1) == 1 {
			time.Sleep(1500 * time.Millisecond) // far past the lease, ignoring ctx
			return errors.New("late failure that must not be recorded")
		}
		return nil
	})
	enqueue(t, pool, schema, effects.Effect{Kind: "x", Key: "k"})
	for range 2 {
		cfg := fastConfig(pool, schema, map[string]effects.Sender{"x": slowFirst})
		cfg.Lease = 300 * time.Millisecond
		cfg.Registerer = reg
		start(t, cfg)
	}
	waitState(t, pool, "x", "k", "done", 30*time.Second)
	// At least the late one: on a loaded machine the attempt that took over may
	// overrun its 300 ms lease as well.
	pgtest.WaitFor(t, 30*time.Second, "lost lease counted", func() bool { return metricValue(t, reg, "idem_effects_lost_lease_total", "x") >= 1 })
	r := getEffect(t, pool, "x", "k")
	require.Equal(t, "done", r.State, "the late failure did not overwrite done")
	require.NotContains(t, r.LastError, "late failure")
}

// TestDispatcherWakesOnNotify: with polling an hour apart, only LISTEN/NOTIFY can
// wake the dispatcher; and it recovers when its LISTEN connection is cut.
func TestDispatcherWakesOnNotify(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	rec := newRecorder(nil)
	cfg := fastConfig(pool, schema, map[string]effects.Sender{"n": rec})
	cfg.PollInterval = time.Hour
	start(t, cfg)
	// Enqueue only once the LISTEN is up: the claim that follows it would find an
	// effect committed before, without a notification.
	admin := pgtest.NewPool(t, "public", 1)
	var first int32
	pgtest.WaitFor(t, 30*time.Second, "LISTEN connection up", func() bool { first = listener(t, admin, schema); return first != 0 })
	enqueue(t, pool, schema, effects.Effect{Kind: "n", Key: "first"})
	waitState(t, pool, "n", "first", "done", 30*time.Second)

	require.Equal(t, first, cutListener(t, admin, schema))
	pgtest.WaitFor(t, 30*time.Second, "LISTEN connection up again", func() bool { return listenerUp(t, admin, schema, first) })
	enqueue(t, pool, schema, effects.Effect{Kind: "n", Key: "second"})
	waitState(t, pool, "n", "second", "done", 30*time.Second)
}

// TestDispatcherPendingGauge: idem_effects_pending counts pending effects by kind.
func TestDispatcherPendingGauge(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	reg := prometheus.NewRegistry()
	enqueueMany(t, pool, "unsent", "u", 7)
	cfg := fastConfig(pool, schema, map[string]effects.Sender{"other": newRecorder(nil)})
	cfg.Registerer = reg
	start(t, cfg)
	pgtest.WaitFor(t, 30*time.Second, "pending gauge", func() bool {
		return metricValue(t, reg, "idem_effects_pending", "unsent") == 7
	})
}

// TestDispatcherRunAgain: Run refuses to run twice at once, and runs again after it
// returned.
func TestDispatcherRunAgain(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	rec := newRecorder(nil)
	d, err := effects.NewDispatcher(fastConfig(pool, schema, map[string]effects.Sender{"a": rec}))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	pgtest.WaitFor(t, 30*time.Second, "running", func() bool {
		return pgtest.Count(t, pool, `SELECT count(*) FROM pg_stat_activity WHERE query = 'LISTEN idem_effects' AND application_name = $1`, "idem-test:"+schema) == 1
	})
	require.ErrorIs(t, d.Run(ctx), effects.ErrDispatcherRunning)
	cancel()
	require.NoError(t, <-done)

	enqueue(t, pool, schema, effects.Effect{Kind: "a", Key: "after-restart"})
	ctx2, cancel2 := context.WithCancel(context.Background())
	go func() { done <- d.Run(ctx2) }()
	waitState(t, pool, "a", "after-restart", "done", 30*time.Second)
	cancel2()
	require.NoError(t, <-done)
}

// Two dispatchers drain one backlog where the role's or database's
// default_transaction_isolation is REPEATABLE READ or SERIALIZABLE: their claims and
// outcome writes run at READ COMMITTED, so neither fails with 40001 when the other
// changed a row after its snapshot; every effect is sent once and nothing is logged
// as an error.
func TestDispatchersUnderAnyDefaultIsolation(t *testing.T) {
	t.Parallel()
	for _, iso := range []string{"repeatable read", "serializable"} {
		t.Run(iso, func(t *testing.T) {
			t.Parallel()
			settings := map[string]string{"default_transaction_isolation": iso}
			pool, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 4, Settings: settings})
			const n = 500
			counts := make([]atomic.Int32, n)
			sender := effects.SenderFunc(func(_ context.Context, d effects.Delivery) error {
				var i int
				if _, err := fmt.Sscanf(d.Key, "k%d", &i); err != nil {
					return err
				}
				counts[i].Add(1)
				return nil
			})
			logs := &logCapture{}
			for range 2 {
				p := pgtest.NewPoolWith(t, schema, pgtest.Options{MaxConns: 4, Settings: settings})
				cfg := fastConfig(p, schema, map[string]effects.Sender{"k": sender})
				cfg.BatchSize = 10
				cfg.Logger = slog.New(logs)
				start(t, cfg)
			}
			enqueueMany(t, pool, "k", "k", n)
			pgtest.WaitFor(t, 30*time.Second, "every effect done", func() bool { return countState(t, pool, "done") == n })
			for i := range counts {
				require.EqualValues(t, 1, counts[i].Load(), "key k%d", i)
			}
			require.Empty(t, logs.errors())
		})
	}
}
