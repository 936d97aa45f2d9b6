package consumer_test

// A message's cancellation before and during its COMMIT, and the consumer's Close.

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/pgtest"
)

// A message whose context is cancelled after its handler
// succeeded and before COMMIT was sent is reported as what happened: nothing
// committed, ErrCanceled (transient, code "canceled"), never commit_unknown. In
// GroupCommit mode a batch does not listen to one message's context, so it commits.
func TestContextCancelledBeforeCommit(t *testing.T) {
	t.Parallel()
	forAllModes(t, func(t *testing.T, mode consumer.Mode) {
		c, b := setup(t, mode, leaseMode(time.Hour))
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
			require.Equal(t, "canceled", inbox.Code(err))
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

// A COMMIT in flight is not cut by the message's cancellation: it
// finishes, and the answer says it committed. The COMMIT is held at a deferred
// trigger that waits for an advisory lock the test holds; the test cancels the
// message's context while it waits, then lets it go.
func TestCommitInFlightIsNotCancelled(t *testing.T) {
	t.Parallel()
	forAllModes(t, func(t *testing.T, mode consumer.Mode) {
		c, b := setup(t, mode, leaseMode(time.Hour))
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
		pgtest.WaitFor(t, time.Minute, "the COMMIT to wait at the trigger", func() bool {
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

// Close races the first message without a data race (run with
// -race), is final (a message after it gets ErrClosed, nacked), and can be called
// twice.
func TestCloseIsSafeAtAnyTimeAndFinal(t *testing.T) {
	t.Parallel()
	forAllModes(t, func(t *testing.T, mode consumer.Mode) {
		pool, schema := pgtest.Setup(t)
		for i := range 20 {
			c, err := consumer.New(consumer.Config{Name: "payments", Pool: pool, Schema: schema, Mode: mode})
			require.NoError(t, err)
			h := c.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
			racing := make(chan error, 1)
			go func() {
				_, err := h(newMsg(fmt.Sprintf("race-%d", i), `{}`))
				racing <- err
			}()
			require.NoError(t, c.Close())
			if err := <-racing; err != nil {
				require.ErrorIs(t, err, consumer.ErrClosed, "the racing message is handled or refused")
			}
			_, err = h(newMsg(fmt.Sprintf("after-%d", i), `{}`))
			require.ErrorIs(t, err, consumer.ErrClosed)
			require.Equal(t, "closed", inbox.Code(err))
			require.False(t, consumer.IsPermanent(err), "nacked, not poisoned")
			require.NoError(t, c.Close(), "a second Close is a no-op")
		}
		require.Zero(t, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE key LIKE 'after-%'`))
	})
}
