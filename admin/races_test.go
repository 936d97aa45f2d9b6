package admin_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/pgtest"
)

// The races of repairing failures, each with real goroutines on real Postgres.

func setupRace(t *testing.T) (*admin.Admin, *testBundle) {
	t.Helper()
	t.Parallel()
	pool, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 16})
	a, err := admin.New(admin.Config{Pool: pool, Schema: schema, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	return a, &testBundle{pool: pool, schema: schema, logs: &syncBuffer{}}
}

// onlyGroup lists the groups and returns the one there is.
func onlyGroup(t *testing.T, a *admin.Admin) admin.FailureGroup {
	t.Helper()
	groups := groupsOf(t, a, admin.GroupFilter{})
	require.Len(t, groups, 1)
	return groups[0]
}

// together runs each fn in its own goroutine, all released at once, and waits.
func together(fns ...func()) {
	var start, done sync.WaitGroup
	start.Add(1)
	for _, fn := range fns {
		done.Add(1)
		go func() {
			defer done.Done()
			start.Wait()
			fn()
		}()
	}
	start.Done()
	done.Wait()
}

// TestReleaseRacingRedelivery: a release of a failed group races three
// redeliveries of each of its keys, handled by a real consumer whose bug is now
// fixed. Whatever the interleaving (a copy that claims before the release replays
// the failure; one after it runs the handler; two after it meet in the inbox), the
// next delivery after the race leaves each key's business work committed exactly
// once.
func TestReleaseRacingRedelivery(t *testing.T) {
	a, b := setupRace(t)
	ctx := context.Background()
	b.exec(t, `CREATE TABLE biz (key text NOT NULL)`)
	var fixed atomic.Bool
	c, err := consumer.New(consumer.Config{Name: "orders", Pool: b.pool, Schema: b.schema})
	require.NoError(t, err)
	handle := c.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if !fixed.Load() {
			return nil, consumer.Permanent(fmt.Errorf("order %s: amount %q invalid", msg.UUID, "1,5"))
		}
		_, err := consumer.Tx(msg.Context()).Exec(msg.Context(), `INSERT INTO biz (key) VALUES ($1)`, msg.UUID)
		return nil, err
	})
	// deliver hands one copy to the consumer until it is acked (a copy that meets a
	// concurrent claim of its key may be nacked, and the broker would redeliver it).
	deliver := func(key string) {
		for {
			if _, err := handle(message.NewMessage(key, []byte(`{"amount":"1,5"}`))); err == nil {
				return
			}
		}
	}
	const rounds, keys = 5, 20
	for round := range rounds {
		fixed.Store(false)
		var names []string
		for i := range keys {
			names = append(names, fmt.Sprintf("r%d-k%d", round, i))
			deliver(names[i])
		}
		g := onlyGroup(t, a)
		require.Equal(t, int64(keys), g.Count)
		fixed.Store(true)

		fns := []func(){func() {
			res, err := a.ReleaseGroup(ctx, admin.GroupAction{ID: g.ID, Through: g.LastSeen, Note: admin.Audit{Who: "ops", Why: "fixed"}})
			require.NoError(t, err)
			require.Equal(t, int64(keys), res.Rows)
		}}
		for _, k := range names {
			for range 3 {
				fns = append(fns, func() { deliver(k) })
			}
		}
		together(fns...)
		for _, k := range names {
			deliver(k) // the next delivery (a republish) after the release
		}
		for _, k := range names {
			require.Equal(t, 1, countOf(t, b, `SELECT count(*) FROM biz WHERE key = '`+k+`'`), "key %s committed once", k)
		}
		require.Equal(t, (round+1)*keys, countOf(t, b, `SELECT count(*) FROM inbox WHERE state = 'completed'`))
		require.Zero(t, countOf(t, b, `SELECT count(*) FROM inbox WHERE state = 'failed'`))
	}
}

// TestRetryRacingDispatcher: a Dispatcher kills each effect on its first attempt
// while two operators keep listing the group and retrying it; the second attempt
// succeeds. Each effect is sent successfully exactly once, after exactly one
// death and one retry, counted by the sender the Dispatcher calls.
func TestRetryRacingDispatcher(t *testing.T) {
	a, b := setupRace(t)
	ctx := context.Background()
	const n = 200
	enqueue(t, b, "mail", n)
	var mu sync.Mutex
	sends, oks := map[string]int{}, map[string]int{}
	d, err := effects.NewDispatcher(effects.Config{Pool: b.pool, Schema: b.schema, PollInterval: 10 * time.Millisecond,
		Senders: map[string]effects.Sender{"mail": effects.SenderFunc(func(_ context.Context, dl effects.Delivery) error {
			mu.Lock()
			defer mu.Unlock()
			sends[dl.Key]++
			if sends[dl.Key] == 1 {
				return effects.Permanent(errors.New("provider rejected " + dl.Key))
			}
			oks[dl.Key]++
			return nil
		})}})
	require.NoError(t, err)
	runCtx, stop := context.WithCancel(ctx)
	ran := make(chan error, 1)
	go func() { ran <- d.Run(runCtx) }()

	allDone := func() bool { return countOf(t, b, `SELECT count(*) FROM effects WHERE state = 'done'`) == n }
	var retried atomic.Int64
	operator := func() {
		deadline := time.Now().Add(30 * time.Second)
		for !allDone() && time.Now().Before(deadline) {
			p, err := a.ListGroups(ctx, admin.GroupFilter{Kind: "mail"}, admin.Page{})
			require.NoError(t, err)
			for _, g := range p.Rows {
				res, err := a.RetryGroup(ctx, admin.GroupAction{ID: g.ID, Through: g.LastSeen, Note: admin.Audit{Who: "ops", Why: "provider fixed"}})
				require.NoError(t, err)
				retried.Add(res.Rows)
			}
		}
	}
	together(operator, operator)
	stop()
	require.NoError(t, <-ran)
	require.True(t, allDone())
	require.Len(t, oks, n)
	for k, c := range oks {
		require.Equal(t, 1, c, "%s sent successfully once", k)
		require.Equal(t, 2, sends[k], "%s: one attempt that died, one after the retry", k)
	}
	require.Equal(t, int64(n), retried.Load(), "each effect retried once in all")
}

// TestTwoOperatorsRetry: four operators retry the same group at the same moment;
// each effect is requeued once, and the stored actions add up to the group.
func TestTwoOperatorsRetry(t *testing.T) {
	a, b := setupRace(t)
	ctx := context.Background()
	const n = 300
	b.killEffects(t, "mail", "m", n, func(key string) error { return errors.New("rejected " + key) })
	g := onlyGroup(t, a)
	var total atomic.Int64
	op := func() {
		res, err := a.RetryGroup(ctx, admin.GroupAction{ID: g.ID, Through: g.LastSeen, Note: admin.Audit{Who: "ops", Why: "fixed"}})
		require.NoError(t, err)
		total.Add(res.Rows)
	}
	together(op, op, op, op)
	require.Equal(t, int64(n), total.Load(), "each effect requeued by exactly one of the operators")
	require.Equal(t, n, countOf(t, b, `SELECT count(*) FROM effects WHERE state = 'pending' AND attempts = 0`))
	require.Equal(t, n, countOf(t, b, `SELECT sum(affected)::int FROM failure_actions WHERE action = 'retry'`))
	require.Equal(t, 4, countOf(t, b, `SELECT count(*) FROM failure_actions`))
}

// TestDiscardRacingRetry: operators retry and discard the same group at once;
// each effect ends in exactly one of the two states, and the counts each action
// reports are the rows in its state.
func TestDiscardRacingRetry(t *testing.T) {
	a, b := setupRace(t)
	ctx := context.Background()
	const n = 300
	b.killEffects(t, "mail", "m", n, func(key string) error { return errors.New("rejected " + key) })
	g := onlyGroup(t, a)
	var retried, discarded atomic.Int64
	act := func(f func(context.Context, admin.GroupAction) (*admin.ActionResult, error), into *atomic.Int64) func() {
		return func() {
			res, err := f(ctx, admin.GroupAction{ID: g.ID, Through: g.LastSeen, Note: admin.Audit{Who: "ops", Why: "race"}})
			require.NoError(t, err)
			into.Add(res.Rows)
		}
	}
	together(act(a.RetryGroup, &retried), act(a.DiscardGroup, &discarded), act(a.RetryGroup, &retried), act(a.DiscardGroup, &discarded))
	require.Equal(t, int64(n), retried.Load()+discarded.Load())
	require.Equal(t, int(retried.Load()), countOf(t, b, `SELECT count(*) FROM effects WHERE state = 'pending'`))
	require.Equal(t, int(discarded.Load()), countOf(t, b, `SELECT count(*) FROM effects WHERE state = 'discarded'`))
	require.Zero(t, countOf(t, b, `SELECT count(*) FROM effects WHERE state = 'dead'`))
}

func enqueue(t *testing.T, b *testBundle, kind string, n int) {
	t.Helper()
	ctx := context.Background()
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	for i := range n {
		_, err := effects.Enqueue(effects.WithScope(ctx, effects.Scope{Schema: b.schema}), tx, effects.Effect{Kind: kind, Key: fmt.Sprintf("k%d", i), Payload: []byte(`{}`)})
		require.NoError(t, err)
	}
	require.NoError(t, tx.Commit(ctx))
}
