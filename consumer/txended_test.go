package consumer_test

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/pgtest"
)

// oneConnection gives the consumer a pool of one connection, so that a delivery
// that takes a second connection while it holds its first waits for itself: the
// wait ends at CommitTimeout, and the recording it was for fails.
func oneConnection(t *testing.T) func(*consumer.Config) {
	return func(cfg *consumer.Config) {
		cfg.Pool = pgtest.NewPool(t, cfg.Schema, 1)
		cfg.CommitTimeout = 5 * time.Second
	}
}

// A handler that ends idem's transaction with raw SQL and then goes on writing:
// the writes after its COMMIT or ROLLBACK commit on their own. Its key is recorded
// as failed (code handler_ended_transaction) in a fresh transaction, on a pool of
// one connection, so no redelivery runs the handler again: every business row is
// written once, however often the broker redelivers. The neighbours in its batch
// are run again or nacked, and commit once.
func TestHandlerEndingTheTransactionRunsOnce(t *testing.T) {
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
	var failures []consumer.Failure
	var mu sync.Mutex
	c, b := setup(t, mode, batched, oneConnection(t), func(cfg *consumer.Config) {
		cfg.OnFailure = func(_ context.Context, f consumer.Failure) {
			mu.Lock()
			failures = append(failures, f)
			mu.Unlock()
		}
	})
	var culpritRuns atomic.Int64
	// The culprit misbehaves on every delivery: its business row, then its own end
	// of the transaction, then one more row ("after").
	h := c.Middleware(b.bizHandler(func(msg *message.Message) error {
		if msg.UUID != "k" {
			return nil
		}
		culpritRuns.Add(1)
		ctx := msg.Context()
		tx := consumer.Tx(ctx)
		_, _ = tx.Exec(ctx, endSQL)
		_, err := tx.Exec(ctx, `INSERT INTO biz (key, payload) VALUES ('k', 'after')`)
		return err
	}))
	send := func(key string) error {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		m := newMsg(key, `{}`)
		m.SetContext(ctx)
		_, err := h(m)
		return err
	}
	errs := make([]error, len(keys))
	var wg sync.WaitGroup
	for i, key := range keys {
		wg.Go(func() { errs[i] = send(key) })
	}
	wg.Wait()

	// The handler's own COMMIT commits the claim in Transactional mode; in a
	// group-commit batch the commit guard refuses it; in lease mode the claim is
	// the lease row, outside the handler's transaction.
	ownCommit := mode == consumer.Transactional && strings.HasPrefix(endSQL, "COMMIT")
	for i, key := range keys {
		if key != "k" {
			requireAnswerMatchesInbox(t, b, key, errs[i])
			if errs[i] != nil {
				require.Equal(t, consumer.GroupCommit, mode, "only a batch has neighbours to abort: %v", errs[i])
				require.ErrorIs(t, errs[i], consumer.ErrBatchAborted)
			}
			continue
		}
		require.NoError(t, errs[i], "recorded, and acked")
		state, code := inboxState(t, b, "k")
		if ownCommit {
			require.Equal(t, "completed", state, "the handler's COMMIT committed the key")
		} else {
			require.Equal(t, "failed", state)
			require.Equal(t, "handler_ended_transaction", code)
		}
	}
	require.EqualValues(t, 1, series(t, b.reg, "idem_inbox_failed_total",
		map[string]string{"code": "handler_ended_transaction", "replayed": "false"}))
	mu.Lock()
	require.Len(t, failures, 1)
	require.Equal(t, "k", failures[0].Key)
	require.Equal(t, "handler_ended_transaction", failures[0].Code)
	mu.Unlock()
	runs := culpritRuns.Load()
	require.GreaterOrEqual(t, runs, int64(1))

	// The broker redelivers every nacked message, and k a few times more (a lost
	// ack, a rebalance): k never runs again.
	for i, key := range keys {
		for attempt := 0; errs[i] != nil; attempt++ {
			require.Less(t, attempt, 5, "%s still fails: %v", key, errs[i])
			errs[i] = send(key)
		}
	}
	for range 3 {
		require.NoError(t, send("k"))
	}
	require.Equal(t, runs, culpritRuns.Load(), "no redelivery runs the culprit again")

	for _, key := range keys {
		if key == "k" {
			continue
		}
		state, _ := inboxState(t, b, key)
		require.Equal(t, "completed", state, key)
		require.Equal(t, 1, b.bizRows(t, key), "%s committed once", key)
	}
	after := pgtest.Count(t, b.pool, `SELECT count(*) FROM biz WHERE key = 'k' AND payload = 'after'`)
	before := pgtest.Count(t, b.pool, `SELECT count(*) FROM biz WHERE key = 'k' AND payload = '{}'`)
	require.LessOrEqual(t, after, 1, "the culprit's write after its end committed twice")
	require.LessOrEqual(t, before, 1, "the culprit's write before its end committed twice")
	if endSQL == "ROLLBACK" || endSQL == "COMMIT" {
		require.Equal(t, 1, after, "with no BEGIN after it, the write after the end commits on its own")
	}
	if ownCommit {
		require.Equal(t, 1, before, "its COMMIT committed the write before it")
	}
}

// A batch handler that ends idem's transaction and goes on writing, for the whole
// call: every message of the call that did it is recorded as failed (the writes
// after the end are any message's), and none is run again; messages the call did
// not get are not touched.
func TestBatchHandlerEndingTheTransactionRunsOnce(t *testing.T) {
	t.Parallel()
	for _, endSQL := range []string{"COMMIT", "ROLLBACK", "COMMIT; BEGIN", "ROLLBACK; BEGIN"} {
		t.Run(endSQL, func(t *testing.T) {
			t.Parallel()
			h, bb, b := setupBatch(t, oneConnection(t))
			// A key committed before: a duplicate, which the batch handler never gets.
			require.NoError(t, h(newMsg("dup", `{}`)))
			var misbehave atomic.Bool
			misbehave.Store(true)
			bb.after = func(ctx context.Context, tx pgx.Tx, msgs []*message.Message) error {
				if !misbehave.Load() {
					return nil
				}
				_, _ = tx.Exec(ctx, endSQL)
				keys := make([]string, len(msgs))
				for i, m := range msgs {
					keys[i] = m.UUID
				}
				_, err := tx.Exec(ctx, `INSERT INTO biz (key, payload) SELECT k, 'after' FROM unnest($1::text[]) AS k`, keys)
				return err
			}
			keys := []string{"a", "dup", "k", "z"}
			msgs := make([]*message.Message, len(keys))
			for i, k := range keys {
				msgs[i] = newMsg(k, `{}`)
			}
			errs := sendTogether(h, msgs...)
			calls := len(bb.calls())
			for i, key := range keys {
				requireAnswerMatchesInbox(t, b, key, errs[i])
				if key == "dup" {
					require.NoError(t, errs[i])
					continue
				}
				if errs[i] == nil {
					state, code := inboxState(t, b, key)
					require.Equal(t, "failed", state, key)
					require.Equal(t, "handler_ended_transaction", code, key)
				}
			}
			// With a BEGIN after the ROLLBACK the set-based batch sees the change
			// only at its COMMIT, through the last call; either way each message is
			// recorded or nacked, and the redeliveries settle.
			misbehave.Store(false)
			for i, key := range keys {
				for attempt := 0; errs[i] != nil; attempt++ {
					require.Less(t, attempt, 5, "%s still fails: %v", key, errs[i])
					errs[i] = h(newMsg(key, `{}`))
				}
			}
			for _, key := range []string{"a", "k", "z"} {
				state, _ := inboxState(t, b, key)
				after := pgtest.Count(t, b.pool, `SELECT count(*) FROM biz WHERE key = $1 AND payload = 'after'`, key)
				require.LessOrEqual(t, after, 1, "%s: a write after the end committed twice", key)
				if state == "completed" {
					require.Equal(t, 1, b.bizRows(t, key)-after, "%s completed, so its work is there once", key)
					continue
				}
				require.Equal(t, "failed", state, key)
			}
			state, _ := inboxState(t, b, "dup")
			require.Equal(t, "completed", state)
			require.Equal(t, 1, b.bizRows(t, "dup"))
			if endSQL == "COMMIT" || endSQL == "ROLLBACK" {
				// Seen as soon as the call returns: the call's messages are recorded
				// at once and never run again.
				require.Equal(t, 1, calls-1, "one call: the first was dup's own batch")
				for _, key := range []string{"a", "k", "z"} {
					state, code := inboxState(t, b, key)
					require.Equal(t, "failed", state, key)
					require.Equal(t, "handler_ended_transaction", code)
					require.Equal(t, 1, pgtest.Count(t, b.pool, `SELECT count(*) FROM biz WHERE key = $1 AND payload = 'after'`, key))
				}
				require.Equal(t, calls, len(bb.calls()), "no redelivery ran the batch handler")
			}
		})
	}
}
