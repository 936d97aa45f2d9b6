package consumer_test

// Tests of the set-based group commit: the shape of a batch's statements, and how
// a failing message is isolated without savepoints on the hot path. The
// correctness table (consumer_test.go, handler_test.go, cancel_test.go,
// errors_test.go, crash_test.go) runs in GroupCommit mode as well.

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/pgtest"
)

// sqlLog records every statement a pool sends, and its round trips (a query, or a
// pipelined batch, is one).
type sqlLog struct {
	mu    sync.Mutex
	sqls  []string
	trips int
}

func (l *sqlLog) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	l.mu.Lock()
	l.sqls = append(l.sqls, d.SQL)
	l.trips++
	l.mu.Unlock()
	return ctx
}
func (l *sqlLog) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (l *sqlLog) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	l.mu.Lock()
	l.trips++
	l.mu.Unlock()
	return ctx
}
func (l *sqlLog) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	l.mu.Lock()
	l.sqls = append(l.sqls, d.SQL)
	l.mu.Unlock()
}
func (l *sqlLog) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// count returns how many statements contain every one of parts, and clears nothing.
func (l *sqlLog) count(parts ...string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
next:
	for _, s := range l.sqls {
		for _, p := range parts {
			if !strings.Contains(s, p) {
				continue next
			}
		}
		n++
	}
	return n
}

func (l *sqlLog) reset() {
	l.mu.Lock()
	l.sqls, l.trips = nil, 0
	l.mu.Unlock()
}

// tracedPool is a second pool on a test schema whose statements go to a sqlLog.
func tracedPool(t *testing.T, schema string) (*pgxpool.Pool, *sqlLog) {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	require.NoError(t, err)
	cfg.MaxConns = 4
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.ConnConfig.RuntimeParams["application_name"] = "idem-test:" + schema
	log := &sqlLog{}
	cfg.ConnConfig.Tracer = log
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool, log
}

// sendTogether hands the messages to h at once, so that they form one batch, and
// returns each one's answer.
func sendTogether(h func(*message.Message) error, msgs ...*message.Message) []error {
	errs := make([]error, len(msgs))
	var wg sync.WaitGroup
	for i, m := range msgs {
		wg.Go(func() { errs[i] = h(m) })
	}
	wg.Wait()
	return errs
}

func middlewareFunc(h message.HandlerFunc) func(*message.Message) error {
	return func(m *message.Message) error { _, err := h(m); return err }
}

// A batch of ordinary handlers costs one claim statement, one effects statement and
// one COMMIT, whatever its size: no savepoint per message, no Enqueue round trip. A
// redelivered batch needs no second statement to read the rows it met.
func TestGroupCommitIsSetBased(t *testing.T) {
	t.Parallel()
	_, b := setup(t, consumer.Transactional)
	pool, log := tracedPool(t, b.schema)
	// SkipSchemaCheck: the round trips counted below are the batch's alone (New's
	// check is three more, before any message).
	c, err := consumer.New(consumer.Config{Name: "payments", Pool: pool, Schema: b.schema, Mode: consumer.GroupCommit,
		Batch: consumer.BatchConfig{MaxWait: 300 * time.Millisecond, Workers: 1}, Registerer: b.reg, SkipSchemaCheck: true})
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	h := middlewareFunc(c.Middleware(b.bizHandler(nil)))

	var msgs []*message.Message
	for _, k := range []string{"h", "c", "f", "a", "g", "b", "e", "d"} {
		msgs = append(msgs, newMsg(k, `{}`))
	}
	for _, err := range sendTogether(h, msgs...) {
		require.NoError(t, err)
	}
	require.Equal(t, 8, pgtest.Count(t, b.pool, `SELECT count(*) FROM biz`))
	require.Equal(t, 8, b.effectRows(t))
	require.Equal(t, 1, log.count("unnest", "inbox"), "one claim statement for the batch")
	require.Equal(t, 1, log.count("unnest", "effects"), "one effects statement for the batch")
	require.Zero(t, log.count("SAVEPOINT idem_0"), "no savepoint per message")
	require.Equal(t, 1, log.count("SAVEPOINT idem_batch"), "one savepoint, in the claim's round trip")
	require.Equal(t, 1, log.count("COMMIT"))
	log.mu.Lock()
	trips := log.trips
	log.mu.Unlock()
	// The consumer's one question whether its schema is on Citus (internal/citusmode),
	// then BEGIN, the claim's pipeline, 8 business inserts, the effects, COMMIT.
	require.Equal(t, 13, trips, "%q", log.sqls)

	// The broker redelivers four of them with two new ones: duplicates, read by the
	// claim itself.
	log.reset()
	errs := sendTogether(h, newMsg("a", `{}`), newMsg("x", `{}`), newMsg("c", `{}`), newMsg("e", `{}`), newMsg("y", `{}`), newMsg("g", `{}`))
	for _, err := range errs {
		require.NoError(t, err)
	}
	require.EqualValues(t, 4, b.counter("idem_inbox_duplicates_total"))
	require.EqualValues(t, 10, b.calls.Load())
	require.Equal(t, 1, log.count("unnest", "inbox"), "no second statement for rows committed before the claim")
	require.Equal(t, 10, pgtest.Count(t, b.pool, `SELECT count(*) FROM biz`))
}

// A handler failure rolls back to the savepoint before the claim and runs the rest
// of the batch again, without the failed message: its neighbours commit, each
// once; a permanent failure is recorded for its message alone, in the same
// transaction; a transient one is nacked. No savepoint per message is made.
func TestGroupCommitFailureRerunsTheRestWithoutIt(t *testing.T) {
	t.Parallel()
	for _, permanent := range []bool{false, true} {
		t.Run(map[bool]string{false: "transient", true: "permanent"}[permanent], func(t *testing.T) {
			t.Parallel()
			_, b := setup(t, consumer.Transactional)
			pool, log := tracedPool(t, b.schema)
			c, err := consumer.New(consumer.Config{Name: "payments", Pool: pool, Schema: b.schema, Mode: consumer.GroupCommit,
				Batch: consumer.BatchConfig{MaxWait: 300 * time.Millisecond, Workers: 1}, Registerer: b.reg})
			require.NoError(t, err)
			t.Cleanup(func() { _ = c.Close() })
			var mu sync.Mutex
			calls := map[string]int{}
			h := middlewareFunc(c.Middleware(b.bizHandler(func(m *message.Message) error {
				mu.Lock()
				calls[m.UUID]++
				mu.Unlock()
				if m.UUID == "b" {
					if permanent {
						return consumer.Permanent(errors.New("card declined"))
					}
					return errors.New("ledger timeout")
				}
				return nil
			})))
			errs := sendTogether(h, newMsg("c", `{}`), newMsg("b", `{}`), newMsg("a", `{}`))
			require.NoError(t, errs[0])
			require.NoError(t, errs[2])
			state, code := inboxState(t, b, "b")
			if permanent {
				require.NoError(t, errs[1], "recorded and acked")
				require.Equal(t, "failed", state)
				require.Equal(t, "permanent", code)
			} else {
				require.ErrorContains(t, errs[1], "ledger timeout")
				require.Empty(t, state)
			}
			require.Equal(t, map[string]int{"a": 2, "b": 1, "c": 1}, calls,
				"a ran before b failed and again after; c only after; b once")
			require.Equal(t, 1, b.bizRows(t, "a"))
			require.Equal(t, 1, b.bizRows(t, "c"))
			require.Zero(t, b.bizRows(t, "b"))
			require.Equal(t, 2, b.effectRows(t))
			require.Equal(t, 2, log.count("unnest", "inbox"), "the first claim, and the claim after the rollback")
			require.Equal(t, 1, log.count("ROLLBACK TO SAVEPOINT idem_batch"))
			require.Zero(t, log.count("SAVEPOINT idem_0"))
			require.Equal(t, 1, log.count("COMMIT"))
		})
	}
}

// An effect that a handler enqueued is written at the end of the batch; when its key
// is stored already with another payload, the message that enqueued it fails
// permanently (its work rolls back, the failure is recorded under its key) and the
// rest of the batch commits.
func TestGroupCommitEffectMismatchFailsItsMessage(t *testing.T) {
	t.Parallel()
	c, b := setup(t, consumer.GroupCommit, batched)
	ctx := context.Background()
	require.NoError(t, pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		_, err := effects.Enqueue(effects.WithScope(ctx, effects.Scope{Schema: b.schema}), tx,
			effects.Effect{Kind: "email", Key: "receipt:b", Payload: []byte("something else")})
		return err
	}))
	var deferred atomic.Int64
	h := middlewareFunc(c.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx := consumer.Tx(ctx)
		if _, err := tx.Exec(ctx, `INSERT INTO biz (key) VALUES ($1)`, msg.UUID); err != nil {
			return nil, err
		}
		res, err := effects.Enqueue(ctx, tx, effects.Effect{Kind: "email", Key: "receipt:" + msg.UUID, Payload: msg.Payload})
		if res.Deferred {
			deferred.Add(1)
		}
		return nil, err
	}))
	errs := sendTogether(h, newMsg("a", `{}`), newMsg("b", `{}`), newMsg("c", `{}`))
	for _, err := range errs {
		require.NoError(t, err)
	}
	require.Positive(t, deferred.Load(), "enqueued effects wait for the batch's one write")
	state, code := inboxState(t, b, "b")
	require.Equal(t, "failed", state)
	require.Equal(t, "effect_fingerprint_mismatch", code)
	require.Zero(t, b.bizRows(t, "b"))
	require.Equal(t, 1, b.bizRows(t, "a"))
	require.Equal(t, 1, b.bizRows(t, "c"))
	require.Equal(t, 3, b.effectRows(t), "a's, c's, and the one that was there")
}

// A handler that keeps its context and enqueues after it returned is refused
// (ErrBufferClosed), never silently dropped.
func TestGroupCommitLateEnqueueIsRefused(t *testing.T) {
	t.Parallel()
	c, b := setup(t, consumer.GroupCommit)
	var kept context.Context
	var tx pgx.Tx
	h := middlewareFunc(c.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		kept, tx = msg.Context(), consumer.Tx(msg.Context())
		return nil, nil
	}))
	require.NoError(t, h(newMsg("a", `{}`)))
	_, err := effects.Enqueue(kept, tx, effects.Effect{Kind: "email", Key: "late"})
	require.ErrorIs(t, err, effects.ErrBufferClosed)
	require.Zero(t, b.effectRows(t))
}
