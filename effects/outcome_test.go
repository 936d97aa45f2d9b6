package effects_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/pgtest"
)

// binaryJunk is what a sender's error may quote: a NUL byte and bytes that are not
// UTF-8 (a binary response body, a panic value). Postgres text takes neither.
const binaryJunk = "\x00\xff\xfe\x89PNG"

// TestDispatcherBinaryErrorTextIsStored: a sender error holding a NUL byte and
// invalid UTF-8 is stored, escaped, as the effect's last_error, and costs the other
// outcomes nothing: every effect is recorded once and sent once. (Before, Postgres
// rejected the whole outcome batch with 22021: every outcome in it was lost, and its
// effects were sent again after their lease.)
func TestDispatcherBinaryErrorTextIsStored(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	const n = 50
	rec := newRecorder(func(_ context.Context, d effects.Delivery) error {
		switch d.Key {
		case "junk-dead":
			return effects.Permanent(fmt.Errorf("provider answered %s", binaryJunk))
		case "junk-retry":
			if d.Attempt == 1 {
				return errors.New("provider answered " + binaryJunk)
			}
		case "junk-panic":
			if d.Attempt == 1 {
				panic(binaryJunk)
			}
		}
		return nil
	})
	var es []effects.Effect
	for i := range n {
		es = append(es, effects.Effect{Kind: "mail", Key: fmt.Sprintf("ok-%d", i)})
	}
	es = append(es, effects.Effect{Kind: "mail", Key: "junk-dead"}, effects.Effect{Kind: "mail", Key: "junk-retry"},
		effects.Effect{Kind: "mail", Key: "junk-panic"})
	enqueue(t, pool, schema, es...)
	start(t, fastConfig(pool, schema, map[string]effects.Sender{"mail": rec}))

	r := waitState(t, pool, "mail", "junk-dead", "dead", 20*time.Second)
	require.Contains(t, r.LastError, `provider answered \x00\xff\xfe\x89PNG`)
	r = waitState(t, pool, "mail", "junk-retry", "done", 20*time.Second)
	require.Contains(t, r.LastError, `provider answered \x00\xff\xfe\x89PNG`)
	require.Equal(t, 2, r.Attempts)
	r = waitState(t, pool, "mail", "junk-panic", "done", 20*time.Second)
	require.Contains(t, r.LastError, `sender panicked: \x00\xff\xfe\x89PNG`)
	pgtest.WaitFor(t, 20*time.Second, "every effect settled", func() bool { return countState(t, pool, "done") == n+2 })
	for i := range n {
		require.Equal(t, 1, rec.count(fmt.Sprintf("ok-%d", i)), "ok-%d sent once", i)
	}
	require.Equal(t, 1, rec.count("junk-dead"))
}

// TestDispatcherRejectedOutcomeCostsNoOther: when the database still rejects one
// outcome for its data (here a CHECK constraint of the user's on last_error), the
// batch is written row by row: the other outcomes of the batch are kept, and the
// rejected one is recorded without its error text. (Before, the batch failed as a
// whole, three times, and all its effects were sent again after their lease.)
func TestDispatcherRejectedOutcomeCostsNoOther(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `ALTER TABLE effects ADD CONSTRAINT no_rejects CHECK (last_error NOT LIKE '%reject-me%')`)
	require.NoError(t, err)
	const n = 30
	// Every send waits until all have started, so that their outcomes reach the
	// recorder together and share batches.
	var started sync.WaitGroup
	started.Add(n + 1)
	all := make(chan struct{})
	go func() { started.Wait(); close(all) }()
	rec := newRecorder(func(ctx context.Context, d effects.Delivery) error {
		if d.Attempt == 1 {
			started.Done()
			select {
			case <-all:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		if d.Key == "bad" {
			return effects.Permanent(errors.New("reject-me"))
		}
		return nil
	})
	es := []effects.Effect{{Kind: "mail", Key: "bad"}}
	for i := range n {
		es = append(es, effects.Effect{Kind: "mail", Key: fmt.Sprintf("ok-%d", i)})
	}
	enqueue(t, pool, schema, es...)
	cfg := fastConfig(pool, schema, map[string]effects.Sender{"mail": rec})
	cfg.Concurrency = map[string]int{"mail": n + 1}
	start(t, cfg)

	r := waitState(t, pool, "mail", "bad", "dead", 20*time.Second)
	require.Contains(t, r.LastError, "error text could not be stored")
	require.Contains(t, r.LastError, "23514")
	pgtest.WaitFor(t, 20*time.Second, "every other effect done", func() bool { return countState(t, pool, "done") == n })
	for i := range n {
		require.Equal(t, 1, rec.count(fmt.Sprintf("ok-%d", i)), "ok-%d sent once", i)
	}
}

// TestOutcomeWriteAppliedOnceWhenCommitReplyIsLost: the connection is cut after the
// outcome's COMMIT ran on the server and before its reply reached the dispatcher
// (a real cut, by a proxy). The dispatcher retries the write; the retry must change
// nothing and still count the outcome as recorded. (Before, the retry found the
// effect already done and counted a lost lease instead of a done attempt.)
func TestOutcomeWriteAppliedOnceWhenCommitReplyIsLost(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	proxy := newReplyCutter(t)
	proxy.arm("cut-me:done", 1)
	reg := prometheus.NewRegistry()
	rec := newRecorder(nil)
	cfg := fastConfig(proxy.poolVia(schema, 4), schema, map[string]effects.Sender{"mail": rec})
	cfg.Registerer = reg
	start(t, cfg)
	enqueue(t, pool, schema, effects.Effect{Kind: "mail", Key: "cut-me:done"})

	r := waitState(t, pool, "mail", "cut-me:done", "done", 20*time.Second)
	pgtest.WaitFor(t, 20*time.Second, "the outcome counted", func() bool {
		return metricValue(t, reg, "idem_effects_attempts_total", "mail", "done")+
			metricValue(t, reg, "idem_effects_lost_lease_total", "mail") > 0
	})
	require.EqualValues(t, 1, proxy.cut.Load(), "the COMMIT reply was cut")
	require.Zero(t, metricValue(t, reg, "idem_effects_lost_lease_total", "mail"), "a recorded outcome is no lost lease")
	require.EqualValues(t, 1, metricValue(t, reg, "idem_effects_attempts_total", "mail", "done"))
	require.Equal(t, 1, r.Attempts)
	require.False(t, r.InFlight)
	require.Equal(t, 1, rec.count("cut-me:done"))
}

// TestReleasedClaimGivenBackOnceWhenCommitReplyIsLost: a claim released unsent at
// shutdown gives its attempt back once, even when the COMMIT reply of that write is
// lost and the write is retried. (Before, attempts went to -1, the next Delivery.Attempt
// was 0, and the effect got one attempt more than max_attempts.)
func TestReleasedClaimGivenBackOnceWhenCommitReplyIsLost(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	proxy := newReplyCutter(t)
	reg := prometheus.NewRegistry()
	first := make(chan string, 1)
	unblock := make(chan struct{})
	blocking := newRecorder(func(_ context.Context, d effects.Delivery) error {
		first <- d.Key
		<-unblock
		return nil
	})
	cfg := fastConfig(proxy.poolVia(schema, 4), schema, map[string]effects.Sender{"mail": blocking})
	cfg.Concurrency = map[string]int{"mail": 1} // one sending, one waiting in the queue
	cfg.Lease = time.Hour
	cfg.Registerer = reg
	enqueue(t, pool, schema, effects.Effect{Kind: "mail", Key: "k1"}, effects.Effect{Kind: "mail", Key: "k2"})
	stop := start(t, cfg)
	sending := <-first
	waiting := map[string]string{"k1": "k2", "k2": "k1"}[sending]
	pgtest.WaitFor(t, 30*time.Second, "both claimed", func() bool {
		return pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE in_flight`) == 2
	})
	proxy.arm(waiting, 1) // cut the write that releases the waiting claim
	admin := pgtest.NewPool(t, "public", 1)
	pgtest.WaitFor(t, 30*time.Second, "LISTEN connection up", func() bool { return listenerUp(t, admin, schema) })
	stopped := make(chan struct{})
	go func() { stop(); close(stopped) }()
	// Run's context has ended once its LISTEN connection is gone; only then may the
	// send in hand finish, so that the waiting claim is released, not sent.
	waitListenerGone(t, admin, schema)
	close(unblock)
	<-stopped

	require.EqualValues(t, 1, proxy.cut.Load(), "the COMMIT reply was cut")
	r := getEffect(t, pool, "mail", waiting)
	require.Equal(t, "pending", r.State)
	require.Equal(t, 0, r.Attempts, "the released attempt is given back once")
	require.False(t, r.InFlight)
	require.Equal(t, "done", getEffect(t, pool, "mail", sending).State)
	require.Zero(t, metricValue(t, reg, "idem_effects_lost_lease_total", "mail"))
	require.EqualValues(t, 1, metricValue(t, reg, "idem_effects_attempts_total", "mail", "released"))

	rec := newRecorder(nil)
	start(t, fastConfig(pool, schema, map[string]effects.Sender{"mail": rec}))
	r = waitState(t, pool, "mail", waiting, "done", 20*time.Second)
	require.Equal(t, []int{1}, rec.attempts(waiting), "the next attempt is attempt 1")
	require.Equal(t, 1, r.Attempts)
}
