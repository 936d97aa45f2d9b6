package consumer_test

// Tests of the batch handler (Consumer.HandleBatch).

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/pgtest"
)

// batchBiz is a batch handler that writes one business row per message with one
// INSERT … SELECT FROM unnest, and one email effect per message. fail, if set,
// may return an error naming some of the messages (or none), before any write.
type batchBiz struct {
	b    *bundle
	mu   sync.Mutex
	seen [][]string // the keys of each call
	// deferred counts the effects left for the batch's one write (all of them on
	// the set-based path; none when a failure made idem run messages alone).
	deferred atomic.Int64
	fail     func(msgs []*message.Message) error
	after    func(ctx context.Context, tx pgx.Tx, msgs []*message.Message) error
}

func (bb *batchBiz) handle(ctx context.Context, tx pgx.Tx, msgs []*message.Message) error {
	keys := make([]string, len(msgs))
	payloads := make([]string, len(msgs))
	for i, m := range msgs {
		keys[i], payloads[i] = m.UUID, string(m.Payload)
	}
	bb.mu.Lock()
	bb.seen = append(bb.seen, keys)
	bb.mu.Unlock()
	bb.b.calls.Add(int64(len(msgs)))
	if bb.fail != nil {
		if err := bb.fail(msgs); err != nil {
			return err
		}
	}
	if _, err := consumer.TxSafely(ctx); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, `INSERT INTO biz (key, payload) SELECT * FROM unnest($1::text[], $2::text[])`, keys, payloads); err != nil {
		return err
	}
	for _, m := range msgs {
		res, err := effects.Enqueue(m.Context(), tx, effects.Effect{Kind: "email", Key: "receipt:" + m.UUID, Payload: m.Payload})
		if err != nil {
			return consumer.ForMessage(m, err)
		}
		if res.Deferred {
			bb.deferred.Add(1)
		}
	}
	if bb.after != nil {
		return bb.after(ctx, tx, msgs)
	}
	return nil
}

func (bb *batchBiz) calls() [][]string {
	bb.mu.Lock()
	defer bb.mu.Unlock()
	return slices.Clone(bb.seen)
}

func setupBatch(t *testing.T, mutate ...func(*consumer.Config)) (func(*message.Message) error, *batchBiz, *bundle) {
	t.Helper()
	c, b := setup(t, consumer.Transactional, append([]func(*consumer.Config){batched}, mutate...)...)
	bb := &batchBiz{b: b}
	return c.HandleBatch(bb.handle), bb, b
}

// One call for the batch, with only the messages whose keys it claimed: duplicates,
// recorded failures and mismatches never reach it, and copies of one key in the
// batch are answered from the first one's claim.
func TestBatchHandlerSeesOnlyClaimedMessages(t *testing.T) {
	t.Parallel()
	h, bb, b := setupBatch(t)
	errs := sendTogether(h, newMsg("k3", `{"n":3}`), newMsg("k1", `{"n":1}`), newMsg("k2", `{"n":2}`))
	for _, err := range errs {
		require.NoError(t, err)
	}
	require.Equal(t, [][]string{{"k1", "k2", "k3"}}, bb.calls(), "one call, keys in order")
	require.Equal(t, 3, pgtest.Count(t, b.pool, `SELECT count(*) FROM biz`))
	require.Equal(t, 3, b.effectRows(t))
	require.EqualValues(t, 3, bb.deferred.Load(), "written with the batch's one statement")
	var src string
	require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT source_key FROM effects WHERE key = 'receipt:k2'`).Scan(&src))
	require.Equal(t, "k2", src, "each effect belongs to its message")

	errs = sendTogether(h,
		newMsg("k1", `{"n":1}`),  // a duplicate
		newMsg("k2", `{"n":99}`), // the same key, another command
		newMsg("k4", `{"n":4}`),
		newMsg("k4", `{"n":4}`), // a copy in the same batch
		newMsg("k5", `{"n":5}`),
	)
	require.NoError(t, errs[0])
	require.ErrorIs(t, errs[1], consumer.ErrFingerprintMismatch)
	require.NoError(t, errs[2])
	require.NoError(t, errs[3])
	require.NoError(t, errs[4])
	require.Equal(t, []string{"k4", "k5"}, bb.calls()[1])
	require.EqualValues(t, 2, b.counter("idem_inbox_duplicates_total"))
	require.EqualValues(t, 1, b.counter("idem_inbox_fingerprint_mismatch_total"))
	require.Equal(t, 5, pgtest.Count(t, b.pool, `SELECT count(*) FROM biz`))
	require.Equal(t, 1, b.bizRows(t, "k4"))
}

// A batch handler that names its failing messages (ForMessage, joined) gets the
// batch again without them: a permanent failure is recorded for its message alone,
// a transient one is nacked, and the rest commit once.
func TestBatchHandlerNamedFailuresAreIsolated(t *testing.T) {
	t.Parallel()
	var failures []consumer.Failure
	var mu sync.Mutex
	h, bb, b := setupBatch(t, func(cfg *consumer.Config) {
		cfg.OnFailure = func(_ context.Context, f consumer.Failure) {
			mu.Lock()
			failures = append(failures, f)
			mu.Unlock()
		}
	})
	bb.fail = func(msgs []*message.Message) error {
		var errs []error
		for _, m := range msgs {
			var p struct{ Amount int }
			if err := json.Unmarshal(m.Payload, &p); err != nil {
				errs = append(errs, consumer.ForMessage(m, consumer.Permanent(err)))
			} else if p.Amount < 0 {
				errs = append(errs, consumer.ForMessage(m, errors.New("ledger busy")))
			}
		}
		return errors.Join(errs...)
	}
	errs := sendTogether(h,
		newMsg("a", `{"amount":1}`),
		newMsg("b", `not json`),
		newMsg("c", `{"amount":-1}`),
		newMsg("d", `{"amount":4}`),
	)
	require.NoError(t, errs[0])
	require.NoError(t, errs[1], "recorded and acked")
	require.ErrorContains(t, errs[2], "ledger busy")
	require.False(t, consumer.IsPermanent(errs[2]))
	require.NoError(t, errs[3])
	require.Equal(t, [][]string{{"a", "b", "c", "d"}, {"a", "d"}}, bb.calls(), "run once more, without the named ones")
	state, code := inboxState(t, b, "b")
	require.Equal(t, "failed", state)
	require.Equal(t, "permanent", code)
	state, _ = inboxState(t, b, "c")
	require.Empty(t, state, "a transient failure is never recorded")
	require.Equal(t, []string{"a", "d"}, bizKeys(t, b))
	require.Equal(t, 2, b.effectRows(t))
	mu.Lock()
	require.Len(t, failures, 1)
	require.Equal(t, "b", failures[0].Key)
	mu.Unlock()

	// The redeliveries: b's failure is replayed without running; c runs now.
	bb.fail = nil
	errs = sendTogether(h, newMsg("b", `not json`), newMsg("c", `{"amount":-1}`))
	require.NoError(t, errs[0])
	require.NoError(t, errs[1])
	require.Equal(t, []string{"c"}, bb.calls()[2])
	require.Equal(t, []string{"a", "c", "d"}, bizKeys(t, b))
}

func bizKeys(t *testing.T, b *bundle) []string {
	t.Helper()
	rows, err := b.pool.Query(context.Background(), `SELECT key FROM biz ORDER BY key`)
	require.NoError(t, err)
	keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return keys
}

// An error that names no message (here a poison row that fails the set-based
// INSERT, or a panic) cannot be pinned on one: idem bisects, each half in a
// savepoint of its own, until the poison message fails alone; the rest run once
// more together and commit.
func TestBatchHandlerUnnamedFailureIsolatesThePoisonMessage(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"constraint", "panic", "permanent"} {
		t.Run(how, func(t *testing.T) {
			t.Parallel()
			h, bb, b := setupBatch(t)
			_, err := b.pool.Exec(context.Background(), `ALTER TABLE biz ADD CONSTRAINT no_poison CHECK (payload <> 'poison')`)
			require.NoError(t, err)
			switch how {
			case "panic":
				bb.fail = func(msgs []*message.Message) error {
					for _, m := range msgs {
						if string(m.Payload) == "poison" {
							panic("poison pill")
						}
					}
					return nil
				}
			case "permanent":
				bb.fail = func(msgs []*message.Message) error {
					for _, m := range msgs {
						if string(m.Payload) == "poison" {
							return consumer.Permanent(errors.New("poison in the batch"))
						}
					}
					return nil
				}
			}
			errs := sendTogether(h, newMsg("a", `ok`), newMsg("b", `poison`), newMsg("c", `ok`))
			require.NoError(t, errs[0])
			require.NoError(t, errs[2])
			switch how {
			case "constraint":
				require.ErrorContains(t, errs[1], "no_poison")
				require.False(t, consumer.IsPermanent(errs[1]))
			case "panic":
				require.ErrorContains(t, errs[1], "poison pill")
			case "permanent":
				require.NoError(t, errs[1], "recorded for the poison message alone")
				state, _ := inboxState(t, b, "b")
				require.Equal(t, "failed", state)
			}
			require.Equal(t, []string{"a", "c"}, bizKeys(t, b))
			require.Equal(t, [][]string{{"a", "b", "c"}, {"a"}, {"b", "c"}, {"b"}, {"c"}, {"a", "c"}}, bb.calls(),
				"the batch, its halves (the failing one halved again), then the rest together")
			state, _ := inboxState(t, b, "a")
			require.Equal(t, "completed", state)
		})
	}
}

// An effect of the batch whose key is stored with another payload fails the message
// that enqueued it, permanently, and the rest commit.
func TestBatchHandlerEffectMismatchFailsItsMessage(t *testing.T) {
	t.Parallel()
	h, bb, b := setupBatch(t)
	ctx := context.Background()
	require.NoError(t, pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		_, err := effects.Enqueue(effects.WithScope(ctx, effects.Scope{Schema: b.schema}), tx,
			effects.Effect{Kind: "email", Key: "receipt:b", Payload: []byte("something else")})
		return err
	}))
	errs := sendTogether(h, newMsg("a", `{}`), newMsg("b", `{}`), newMsg("c", `{}`))
	for _, err := range errs {
		require.NoError(t, err)
	}
	state, code := inboxState(t, b, "b")
	require.Equal(t, "failed", state)
	require.Equal(t, "effect_fingerprint_mismatch", code)
	require.Equal(t, []string{"a", "c"}, bizKeys(t, b))
	require.Equal(t, [][]string{{"a", "b", "c"}, {"a", "c"}}, bb.calls())
}

// A backend cut in the middle of a batch handler loses nothing and commits nothing
// twice: the batch's messages are nacked or committed, and the redeliveries settle.
func TestBatchHandlerBackendCut(t *testing.T) {
	t.Parallel()
	h, bb, b := setupBatch(t)
	var cut atomic.Bool
	bb.after = func(ctx context.Context, tx pgx.Tx, msgs []*message.Message) error {
		if cut.CompareAndSwap(false, true) {
			_, err := tx.Exec(ctx, `SELECT pg_terminate_backend(pg_backend_pid())`)
			return err
		}
		return nil
	}
	keys := []string{"a", "b", "c", "d"}
	msgs := make([]*message.Message, len(keys))
	for i, k := range keys {
		msgs[i] = newMsg(k, `{}`)
	}
	errs := sendTogether(h, msgs...)
	for i, key := range keys {
		requireAnswerMatchesInbox(t, b, key, errs[i])
		for attempt := 0; errs[i] != nil; attempt++ {
			require.Less(t, attempt, 5, "%s still fails: %v", key, errs[i])
			errs[i] = h(newMsg(key, `{}`))
		}
	}
	require.Equal(t, keys, bizKeys(t, b))
}

// Two consumers (two processes, say) get the same keys at once, in opposite orders,
// through batch handlers: each key commits once, and no batch fails on a deadlock.
func TestBatchHandlersOnTwoConsumersShareKeys(t *testing.T) {
	t.Parallel()
	h1, bb1, b := setupBatch(t)
	c2, err := consumer.New(consumer.Config{Name: "payments", Pool: b.pool, Schema: b.schema, Batch: consumer.BatchConfig{MaxWait: 300 * time.Millisecond, Workers: 1}, LockTimeout: 30 * time.Second})
	require.NoError(t, err)
	t.Cleanup(func() { _ = c2.Close() })
	bb2 := &batchBiz{b: b}
	h2 := c2.HandleBatch(bb2.handle)
	slow := func(ctx context.Context, tx pgx.Tx, msgs []*message.Message) error {
		time.Sleep(50 * time.Millisecond) // hold the claims while the other batch arrives
		return nil
	}
	bb1.after, bb2.after = slow, slow
	var keys []string
	for i := range 30 {
		keys = append(keys, fmt.Sprintf("key-%02d", i))
	}
	var wg sync.WaitGroup
	var failed atomic.Int64
	for w, h := range []func(*message.Message) error{h1, h2} {
		order := slices.Clone(keys)
		if w == 1 {
			slices.Reverse(order)
		}
		for _, k := range order {
			wg.Go(func() {
				if err := h(newMsg(k, `{}`)); err != nil {
					failed.Add(1)
					t.Errorf("%s: %v", k, err)
				}
			})
		}
	}
	wg.Wait()
	require.Zero(t, failed.Load())
	require.Equal(t, keys, bizKeys(t, b))
	require.EqualValues(t, len(keys), b.calls.Load(), "each key ran in one batch handler call")
}

// Through a Watermill router: many partitions (topics) deliver at once, the batch
// handler gets them in batches, and every message commits once with its effect,
// duplicates included.
func TestBatchHandlerInARouter(t *testing.T) {
	t.Parallel()
	c, b := setup(t, consumer.Transactional, func(cfg *consumer.Config) {
		cfg.Name = ""
		cfg.Batch.MaxBatch = 64
		cfg.Batch.MaxWait = time.Millisecond
	})
	bb := &batchBiz{b: b}
	h := c.HandleBatch(bb.handle)
	pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 1024}, watermill.NopLogger{})
	defer func() { require.NoError(t, pubsub.Close()) }()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	poison, err := middleware.PoisonQueueWithFilter(pubsub, "poison", consumer.IsPermanent)
	require.NoError(t, err)
	retry := middleware.Retry{MaxRetries: 5, InitialInterval: time.Millisecond, ShouldRetry: consumer.ShouldRetry}
	const partitions = 16
	for p := range partitions {
		topic := fmt.Sprintf("in-%d", p)
		r.AddConsumerHandler("payments-"+topic, topic, pubsub, h).AddMiddleware(poison, retry.Middleware)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = r.Run(ctx) }()
	<-r.Running()
	defer func() { cancel(); <-done }()

	const n = 1000
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range n {
		id := consumer.NewUUID()
		topic := fmt.Sprintf("in-%d", i%partitions)
		copies := 1 + rng.IntN(2)
		for range copies {
			require.NoError(t, pubsub.Publish(topic, message.NewMessage(id, fmt.Appendf(nil, `{"n":%d}`, i))))
		}
	}
	pgtest.WaitFor(t, time.Minute, "1,000 messages", func() bool {
		return pgtest.Count(t, b.pool, `SELECT count(*) FROM inbox`) == n
	})
	require.Equal(t, n, pgtest.Count(t, b.pool, `SELECT count(DISTINCT key) FROM biz`))
	require.Equal(t, n, pgtest.Count(t, b.pool, `SELECT count(*) FROM biz`), "committed twice")
	require.Equal(t, n, b.effectRows(t))
	calls := bb.calls()
	require.Less(t, len(calls), n, "messages were batched")
}

func TestHandleBatchRefusesLeaseMode(t *testing.T) {
	t.Parallel()
	c, _ := setup(t, consumer.Lease)
	require.PanicsWithValue(t, "idem: HandleBatch needs Transactional or GroupCommit mode; Lease mode has no batches", func() {
		c.HandleBatch(func(context.Context, pgx.Tx, []*message.Message) error { return nil })
	})
}

// Close stops a batch handler's workers too: a message after it gets ErrClosed, and
// a message racing it is handled or refused.
func TestHandleBatchAfterClose(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.Setup(t)
	for i := range 10 {
		c, err := consumer.New(consumer.Config{Name: "payments", Pool: pool, Schema: schema})
		require.NoError(t, err)
		h := c.HandleBatch(func(context.Context, pgx.Tx, []*message.Message) error { return nil })
		racing := make(chan error, 1)
		go func() { racing <- h(newMsg(fmt.Sprintf("race-%d", i), `{}`)) }()
		require.NoError(t, c.Close())
		if err := <-racing; err != nil {
			require.ErrorIs(t, err, consumer.ErrClosed)
		}
		require.ErrorIs(t, h(newMsg(fmt.Sprintf("after-%d", i), `{}`)), consumer.ErrClosed)
	}
	require.Zero(t, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE key LIKE 'after-%'`))
}

// A batch handler that names (ForMessage) a message that is not in the batch it was
// given has a bug: idem cannot tell which message failed. Every message of the call
// is nacked with ErrMessageNotInBatch, transient and coded, and none is recorded as
// failed, whatever the error says (here: permanent).
func TestBatchHandlerNamingAMessageOutsideItsBatch(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"another message", "no message", "with one of its own"} {
		t.Run(how, func(t *testing.T) {
			t.Parallel()
			h, bb, b := setupBatch(t)
			stranger := newMsg("stranger", `{}`)
			var bug atomic.Bool
			bug.Store(true)
			bb.fail = func(msgs []*message.Message) error {
				if !bug.Load() {
					return nil
				}
				declined := consumer.Permanent(errors.New("declined"))
				switch how {
				case "another message":
					return consumer.ForMessage(stranger, declined)
				case "no message":
					return consumer.ForMessage(nil, declined)
				}
				return errors.Join(consumer.ForMessage(msgs[0], declined), consumer.ForMessage(stranger, declined))
			}
			msgs := make([]*message.Message, 10)
			for i := range msgs {
				msgs[i] = newMsg(fmt.Sprintf("k%d", i), `{}`)
			}
			errs := sendTogether(h, msgs...)
			for i, err := range errs {
				require.ErrorIs(t, err, consumer.ErrMessageNotInBatch, "message %d", i)
				require.Equal(t, "message_not_in_batch", inbox.Code(err))
				require.False(t, consumer.IsPermanent(err), "never a recorded failure")
				require.ErrorContains(t, err, "declined", "the handler's error is in the text")
			}
			require.Zero(t, pgtest.Count(t, b.pool, `SELECT count(*) FROM inbox`), "nothing recorded")
			require.Zero(t, b.counter("idem_inbox_failed_total"))
			require.EqualValues(t, 10, series(t, b.reg, "idem_inbox_nacked_total", map[string]string{"code": "message_not_in_batch"}))
			require.Len(t, bb.calls(), 1, "one call: nothing to isolate")

			bug.Store(false) // the fix is deployed; the broker redelivers
			for _, err := range sendTogether(h, msgs...) {
				require.NoError(t, err)
			}
			require.Equal(t, 10, pgtest.Count(t, b.pool, `SELECT count(*) FROM inbox WHERE state = 'completed'`))
			require.Equal(t, 10, pgtest.Count(t, b.pool, `SELECT count(*) FROM biz`))
		})
	}
}
