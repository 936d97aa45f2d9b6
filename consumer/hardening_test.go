package consumer_test

// Regression tests for issue 12 ("Hardening"), consumer part. Each runs over every
// mode where the behaviour applies (allModes), and states the guarantee as an
// invariant between the middleware's answer and what Postgres holds, so that it
// keeps holding for a future batch implementation of GroupCommit.

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/pgtest"
)

var allModes = []consumer.Mode{consumer.Transactional, consumer.GroupCommit, consumer.Lease}

func forAllModes(t *testing.T, fn func(t *testing.T, mode consumer.Mode)) {
	for _, mode := range allModes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			fn(t, mode)
		})
	}
}

// batched makes GroupCommit gather the messages a test sends together into one
// batch; it changes nothing in the other modes.
func batched(cfg *consumer.Config) {
	cfg.MaxWait = 300 * time.Millisecond
	cfg.Workers = 1
}

// inboxState is the committed inbox row of key: "" when there is none.
func inboxState(t *testing.T, b *bundle, key string) (state, code string) {
	t.Helper()
	rows, err := b.pool.Query(context.Background(), `SELECT state, coalesce(error_code, '') FROM inbox WHERE key = $1`, key)
	require.NoError(t, err)
	defer rows.Close()
	for rows.Next() {
		require.NoError(t, rows.Scan(&state, &code))
	}
	require.NoError(t, rows.Err())
	return state, code
}

// requireAnswerMatchesInbox is the contract between the middleware's answer and the
// database: an ack (nil) means the key's row and its work are committed; a nack
// carries a stable code.
func requireAnswerMatchesInbox(t *testing.T, b *bundle, key string, err error) {
	t.Helper()
	if err == nil {
		state, _ := inboxState(t, b, key)
		require.Contains(t, []string{"completed", "failed"}, state, "%s was acked, so its inbox row must be committed", key)
		if state == "completed" {
			require.Equal(t, 1, b.bizRows(t, key), "%s was acked as completed, so its work must be committed", key)
		}
		return
	}
	require.NotEmpty(t, consumer.Code(err), "%s: every nack has a stable code: %v", key, err)
}

// Issue 12, item 2. A handler that ends idem's transaction with raw SQL must never
// get a message acked whose row or work is not committed, nor a neighbour of its
// group-commit batch acked with nothing committed; it must never make anything
// commit twice, and it costs its neighbours at most a nack.
func TestHandlerEndingTheTransactionIsDetected(t *testing.T) {
	t.Parallel()
	layouts := map[string][]string{
		// keys are claimed in sorted order, so "k" runs between its neighbours,
		// or last, where only the check in the COMMIT can see it.
		"culprit-in-the-middle": {"a", "k", "m", "z"},
		"culprit-last":          {"a", "b", "k"},
	}
	forAllModes(t, func(t *testing.T, mode consumer.Mode) {
		for _, endSQL := range []string{"ROLLBACK", "COMMIT", "ROLLBACK; BEGIN", "COMMIT; BEGIN"} {
			for layout, keys := range layouts {
				t.Run(endSQL+"/"+layout, func(t *testing.T) {
					t.Parallel()
					testHandlerEndingTheTransaction(t, mode, endSQL, keys)
				})
			}
		}
	})
}

func testHandlerEndingTheTransaction(t *testing.T, mode consumer.Mode, endSQL string, keys []string) {
	c, b := setup(t, mode, batched)
	var misbehave atomic.Bool
	misbehave.Store(true)
	h := c.Middleware(b.bizHandler(func(msg *message.Message) error {
		if msg.UUID == "k" && misbehave.Load() {
			_, err := consumer.Tx(msg.Context()).Exec(msg.Context(), endSQL)
			return err
		}
		return nil
	}))
	errs := make([]error, len(keys))
	var wg sync.WaitGroup
	for i, key := range keys {
		wg.Go(func() { _, errs[i] = h(newMsg(key, `{}`)) })
	}
	wg.Wait()

	for i, key := range keys {
		requireAnswerMatchesInbox(t, b, key, errs[i])
		if key == "k" {
			if mode == consumer.Lease {
				// Whether the work committed is unknown, so the key is recorded
				// as failed rather than run again.
				require.NoError(t, errs[i])
				state, code := inboxState(t, b, "k")
				require.Equal(t, "failed", state)
				require.Equal(t, "tx_ended", code)
			} else {
				require.ErrorIs(t, errs[i], consumer.ErrTxEnded)
				require.Equal(t, "tx_ended", consumer.Code(errs[i]))
				require.False(t, consumer.IsPermanent(errs[i]))
			}
			continue
		}
		if errs[i] != nil {
			require.Equal(t, consumer.GroupCommit, mode, "only a batch has neighbours to abort: %v", errs[i])
			require.ErrorIs(t, errs[i], consumer.ErrBatchAborted)
			require.NotContains(t, errs[i].Error(), `savepoint "`)
		}
	}

	// The broker redelivers every nacked message; the handler behaves now.
	misbehave.Store(false)
	for i, key := range keys {
		for attempt := 0; errs[i] != nil; attempt++ {
			require.Less(t, attempt, 5, "%s still fails: %v", key, errs[i])
			_, errs[i] = h(newMsg(key, `{}`))
		}
	}
	for _, key := range keys {
		n := b.bizRows(t, key)
		require.LessOrEqual(t, n, 1, "%s committed twice", key)
		state, _ := inboxState(t, b, key)
		if key == "k" && mode == consumer.Lease {
			continue // recorded as failed above
		}
		require.Equal(t, "completed", state, key)
		require.Equal(t, 1, n, "%s: completed, so its work is there", key)
	}
}

// Issue 12, item 2 (the aborted case). A handler that swallows a failed statement and
// returns nil gets ErrTxAborted; in a batch it costs only itself.
func TestHandlerSwallowingAFailedStatementCostsOnlyItself(t *testing.T) {
	t.Parallel()
	forAllModes(t, func(t *testing.T, mode consumer.Mode) {
		c, b := setup(t, mode, batched)
		var misbehave atomic.Bool
		misbehave.Store(true)
		h := c.Middleware(b.bizHandler(func(msg *message.Message) error {
			if msg.UUID == "k" && misbehave.Load() {
				_, _ = consumer.Tx(msg.Context()).Exec(msg.Context(), `SELECT 1/0`) // error ignored
			}
			return nil
		}))
		keys := []string{"a", "k", "m"}
		errs := make([]error, len(keys))
		var wg sync.WaitGroup
		for i, key := range keys {
			wg.Go(func() { _, errs[i] = h(newMsg(key, `{}`)) })
		}
		wg.Wait()
		for i, key := range keys {
			requireAnswerMatchesInbox(t, b, key, errs[i])
			if key != "k" {
				require.NoError(t, errs[i], key)
				continue
			}
			require.ErrorIs(t, errs[i], consumer.ErrTxAborted)
			require.Equal(t, "tx_aborted", consumer.Code(errs[i]))
			require.False(t, consumer.IsPermanent(errs[i]))
		}
		misbehave.Store(false)
		_, err := h(newMsg("k", `{}`))
		require.NoError(t, err)
		require.Equal(t, 1, b.bizRows(t, "k"))
	})
}

// Issue 12, item 4. With the tables missing, every message of a batch fails with a
// coded error, the first one with ErrSchemaMissing itself, and no answer is a bare
// error about a savepoint that never ran.
func TestMissingSchemaSurfacesInEveryMode(t *testing.T) {
	t.Parallel()
	forAllModes(t, func(t *testing.T, mode consumer.Mode) {
		pool, schema := pgtest.Setup(t, pgtest.Options{NoMigrate: true})
		cfg := consumer.Config{Name: "x", Pool: pool, Schema: schema, Mode: mode, BusyDelay: time.Millisecond}
		batched(&cfg)
		c, err := consumer.New(cfg)
		require.NoError(t, err)
		t.Cleanup(func() { _ = c.Close() })
		var calls atomic.Int64
		h := c.Middleware(func(*message.Message) ([]*message.Message, error) {
			calls.Add(1)
			return nil, nil
		})
		keys := []string{"a", "b", "c", "d"}
		errs := make([]error, len(keys))
		var wg sync.WaitGroup
		for i, key := range keys {
			wg.Go(func() { _, errs[i] = h(newMsg(key, `{}`)) })
		}
		wg.Wait()
		missing := 0
		for i, err := range errs {
			require.Error(t, err, keys[i])
			require.False(t, consumer.IsPermanent(err), "a missing schema is nacked, never recorded")
			require.NotContains(t, err.Error(), "savepoint", "the real cause, not the rollback's error")
			switch consumer.Code(err) {
			case "schema_missing":
				require.ErrorIs(t, err, consumer.ErrSchemaMissing)
				require.Contains(t, err.Error(), "idem migrate up")
				missing++
			case "batch_aborted":
				require.Equal(t, consumer.GroupCommit, mode)
				require.Contains(t, err.Error(), "idem migrate up", "names the first message's cause")
			default:
				t.Fatalf("%s: unexpected code %q: %v", keys[i], consumer.Code(err), err)
			}
		}
		require.Positive(t, missing, "the first error surfaces with its own code")
		require.Zero(t, calls.Load())
	})
}

// Issue 12, item 7. A message whose context is cancelled after its handler
// succeeded and before COMMIT was sent is reported as what happened: nothing
// committed, ErrCanceled (transient, code "canceled"), never commit_unknown. In
// GroupCommit mode a batch does not listen to one message's context, so it commits.
func TestContextCancelledBeforeCommit(t *testing.T) {
	t.Parallel()
	forAllModes(t, func(t *testing.T, mode consumer.Mode) {
		c, b := setup(t, mode, func(cfg *consumer.Config) { cfg.LeaseDuration = time.Hour })
		var cancelIt atomic.Bool
		cancelIt.Store(true)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		h := c.Middleware(b.bizHandler(func(*message.Message) error {
			if cancelIt.Load() {
				cancel() // the partition is revoked as the handler returns
			}
			return nil
		}))
		msg := newMsg("c-1", `{}`)
		msg.SetContext(ctx)
		_, err := h(msg)
		requireAnswerMatchesInbox(t, b, "c-1", err)
		if mode == consumer.GroupCommit {
			require.NoError(t, err)
		} else {
			require.ErrorIs(t, err, consumer.ErrCanceled)
			require.NotErrorIs(t, err, consumer.ErrCommitUnknown)
			require.Equal(t, "canceled", consumer.Code(err))
			require.False(t, consumer.IsPermanent(err))
			require.Equal(t, 0, b.bizRows(t, "c-1"))
			state, _ := inboxState(t, b, "c-1")
			require.Contains(t, []string{"", "processing"}, state, "nothing committed")
		}

		cancelIt.Store(false)
		_, err = h(newMsg("c-1", `{}`))
		require.NoError(t, err, "the redelivery settles it at once (in Lease mode, the lease was given back)")
		require.Equal(t, 1, b.bizRows(t, "c-1"))
	})
}

// Issue 12, item 7. A COMMIT in flight is not cut by the message's cancellation: it
// finishes, and the answer says it committed. The COMMIT is held at a deferred
// trigger that waits for an advisory lock the test holds; the test cancels the
// message's context while it waits, then lets it go.
func TestCommitInFlightIsNotCancelled(t *testing.T) {
	t.Parallel()
	forAllModes(t, func(t *testing.T, mode consumer.Mode) {
		c, b := setup(t, mode, func(cfg *consumer.Config) { cfg.LeaseDuration = time.Hour })
		ctx := context.Background()
		_, err := b.pool.Exec(ctx, `
			CREATE FUNCTION hold_commit() RETURNS trigger LANGUAGE plpgsql AS $$
			BEGIN
				PERFORM pg_advisory_xact_lock(hashtext(current_schema()));
				RETURN NULL;
			END $$;
			CREATE CONSTRAINT TRIGGER hold_commit AFTER INSERT ON biz
				DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION hold_commit();`)
		require.NoError(t, err)
		holder, err := b.pool.Acquire(ctx)
		require.NoError(t, err)
		defer holder.Release()
		_, err = holder.Exec(ctx, `SELECT pg_advisory_lock(hashtext(current_schema()))`)
		require.NoError(t, err)
		released := false
		unlock := func() {
			if !released {
				released = true
				_, err := holder.Exec(ctx, `SELECT pg_advisory_unlock(hashtext(current_schema()))`)
				require.NoError(t, err)
			}
		}
		defer unlock()

		var pid atomic.Int64
		h := c.Middleware(b.bizHandler(func(msg *message.Message) error {
			var p int64
			err := consumer.Tx(msg.Context()).QueryRow(msg.Context(), `SELECT pg_backend_pid()`).Scan(&p)
			pid.Store(p)
			return err
		}))
		msgCtx, cancel := context.WithCancel(ctx)
		defer cancel()
		msg := newMsg("f-1", `{}`)
		msg.SetContext(msgCtx)
		answer := make(chan error, 1)
		go func() {
			_, err := h(msg)
			answer <- err
		}()
		eventually(t, "the COMMIT to wait at the trigger", func() bool {
			var waiting bool
			err := b.pool.QueryRow(ctx, `SELECT coalesce(bool_or(wait_event_type = 'Lock' AND query ILIKE '%commit%'), false)
				FROM pg_stat_activity WHERE pid = $1`, pid.Load()).Scan(&waiting)
			return err == nil && waiting
		})
		cancel()
		// The COMMIT still waits at the trigger, so no answer may come yet. (pgx cut
		// a COMMIT sent under the message's context at once, and answered
		// commit_unknown, though it went on to commit.)
		select {
		case err := <-answer:
			t.Fatalf("answered while its COMMIT was still waiting: %v", err)
		case <-time.After(200 * time.Millisecond):
		}
		unlock()
		select {
		case err = <-answer:
		case <-time.After(60 * time.Second):
			t.Fatal("no answer")
		}
		require.NoError(t, err, "the COMMIT finished, so the answer is an ack")
		requireAnswerMatchesInbox(t, b, "f-1", err)
	})
}
