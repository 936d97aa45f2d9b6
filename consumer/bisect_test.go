package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/pgtest"
)

// savepointCounter is a pgx tracer that counts, per connection, the SAVEPOINT
// statements sent since the connection's last BEGIN, whoever sent them (idem, or
// a handler through pgx's nested Begin), in plain queries, multi-statement
// strings and pipelines alike. max is the most seen in one transaction, txs the
// transactions that had at least one.
type savepointCounter struct {
	mu     sync.Mutex
	open   map[*pgx.Conn]int
	max    int
	txs    int
	counts []int // per finished transaction that had savepoints
}

var statementStart = regexp.MustCompile(`(?i)^\s*(begin|start\s+transaction|savepoint|commit|end|rollback(\s+to)?|abort)\b`)

func (s *savepointCounter) see(conn *pgx.Conn, sql string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.open == nil {
		s.open = map[*pgx.Conn]int{}
	}
	for _, stmt := range strings.Split(sql, ";") {
		m := statementStart.FindStringSubmatch(stmt)
		if m == nil {
			continue
		}
		switch strings.ToLower(strings.Join(strings.Fields(m[1]), " ")) {
		case "begin", "start transaction":
			s.open[conn] = 0
		case "savepoint":
			s.open[conn]++
			s.max = max(s.max, s.open[conn])
		case "rollback to":
		default: // commit, end, rollback, abort
			if n := s.open[conn]; n > 0 {
				s.txs++
				s.counts = append(s.counts, n)
			}
			s.open[conn] = 0
		}
	}
}

func (s *savepointCounter) TraceQueryStart(ctx context.Context, conn *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	s.see(conn, d.SQL)
	return ctx
}
func (s *savepointCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (s *savepointCounter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}
func (s *savepointCounter) TraceBatchQuery(_ context.Context, conn *pgx.Conn, d pgx.TraceBatchQueryData) {
	s.see(conn, d.SQL)
}
func (s *savepointCounter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

func (s *savepointCounter) most() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.max
}

// countSavepoints gives the consumer a pool whose statements go through a
// savepointCounter.
func countSavepoints(t *testing.T, sc *savepointCounter) func(*consumer.Config) {
	return func(cfg *consumer.Config) {
		pcfg := pgtest.PoolConfig(t, cfg.Schema, pgtest.Options{})
		pcfg.ConnConfig.Tracer = sc
		cfg.Pool = pgtest.OpenPool(t, pcfg)
	}
}

// The counter sees what Postgres sees: savepoints sent as plain statements, in
// multi-statement strings, in pipelines, and by pgx's nested transactions, per
// transaction.
func TestSavepointCounterCountsEveryForm(t *testing.T) {
	t.Parallel()
	_, schema := pgtest.Setup(t)
	sc := &savepointCounter{}
	pcfg := pgtest.PoolConfig(t, schema, pgtest.Options{})
	pcfg.ConnConfig.Tracer = sc
	traced := pgtest.OpenPool(t, pcfg)
	ctx := context.Background()
	require.NoError(t, pgx.BeginFunc(ctx, traced, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SAVEPOINT a; RELEASE SAVEPOINT a; savepoint b"); err != nil {
			return err
		}
		b := &pgx.Batch{}
		b.Queue("SAVEPOINT c")
		b.Queue("ROLLBACK TO SAVEPOINT c")
		if err := tx.SendBatch(ctx, b).Close(); err != nil {
			return err
		}
		return pgx.BeginFunc(ctx, tx, func(pgx.Tx) error { return nil }) // pgx's savepoint
	}))
	require.NoError(t, pgx.BeginFunc(ctx, traced, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "SAVEPOINT a")
		return err
	}))
	require.Equal(t, 4, sc.most())
	require.Equal(t, []int{4, 1}, sc.counts)
}

// One poison message in a batch of 100. A batch handler that names it
// (ForMessage) costs one run more; one that names no message costs a bisection:
// O(log n) runs, and never more than 32 savepoints in one transaction (half of
// the 64 after which Postgres's subtransaction cache overflows). The savepoints are
// counted on the wire.
func TestBatchPoisonIsolationIsLogarithmic(t *testing.T) {
	t.Parallel()
	const n, poison = 100, 37
	// log2(100) rounded up: the levels of halving that single out one message.
	const levels = 7
	for _, tc := range []struct {
		name  string
		named bool
		// most handler calls, SAVEPOINTs in one transaction, and messages handed to
		// the handler over all calls
		calls, savepoints, handled int
	}{
		// the batch, then the 99 others; only idem_batch
		{"named", true, 2, 1, n + n - 1},
		// the batch; two halves a level; the 99 others. idem_batch and a savepoint
		// a half.
		{"unnamed", false, 1 + 2*levels + 1, 1 + 2*levels, n + levels*n + n - 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			sc := &savepointCounter{}
			h, bb, b := setupBatch(t, countSavepoints(t, sc), func(cfg *consumer.Config) { cfg.Batch.MaxBatch = 128 })
			bb.fail = func(msgs []*message.Message) error {
				for _, m := range msgs {
					if string(m.Payload) == "poison" {
						err := consumer.Permanent(errors.New("poison in the batch"))
						if tc.named {
							return consumer.ForMessage(m, err)
						}
						return err
					}
				}
				return nil
			}
			msgs := make([]*message.Message, n)
			for i := range msgs {
				payload := "ok"
				if i == poison {
					payload = "poison"
				}
				msgs[i] = newMsg(fmt.Sprintf("m-%03d", i), payload)
			}
			errs := sendTogether(h, msgs...)
			for i, err := range errs {
				require.NoError(t, err, "message %d", i)
			}
			calls := bb.calls()
			require.Len(t, calls[0], n, "one batch")
			handled := 0
			for _, c := range calls {
				handled += len(c)
			}
			t.Logf("%s poison in %d: %d handler calls, %d messages handled, at most %d savepoints in one transaction",
				tc.name, n, len(calls), handled, sc.most())
			require.LessOrEqual(t, len(calls), tc.calls)
			require.LessOrEqual(t, handled, tc.handled)
			require.LessOrEqual(t, sc.most(), tc.savepoints)
			require.LessOrEqual(t, sc.most(), 64)
			if tc.named {
				require.Equal(t, tc.calls, len(calls))
				require.Equal(t, tc.handled, handled)
			}

			state, code := inboxState(t, b, fmt.Sprintf("m-%03d", poison))
			require.Equal(t, "failed", state)
			require.Equal(t, "permanent", code)
			require.Equal(t, n-1, pgtest.Count(t, b.pool, `SELECT count(*) FROM biz`))
			require.Equal(t, n-1, pgtest.Count(t, b.pool, `SELECT count(DISTINCT key) FROM biz`))
			require.Equal(t, n-1, pgtest.Count(t, b.pool, `SELECT count(*) FROM inbox WHERE state = 'completed'`))
		})
	}
}

// Many poison messages that name no message: the bisection runs out of its
// savepoints in one transaction and goes on in a fresh one, never past 32
// savepoints in a transaction; every innocent message commits once, every poison
// one is recorded.
func TestBatchManyPoisonsStayWithinTheSavepointBound(t *testing.T) {
	t.Parallel()
	const n = 100
	sc := &savepointCounter{}
	h, bb, b := setupBatch(t, countSavepoints(t, sc), func(cfg *consumer.Config) { cfg.Batch.MaxBatch = 128 })
	bb.fail = func(msgs []*message.Message) error {
		for _, m := range msgs {
			if string(m.Payload) == "poison" {
				return consumer.Permanent(errors.New("poison in the batch"))
			}
		}
		return nil
	}
	msgs := make([]*message.Message, n)
	poisons := 0
	for i := range msgs {
		payload := "ok"
		if i%7 == 3 {
			payload = "poison"
			poisons++
		}
		msgs[i] = newMsg(fmt.Sprintf("m-%03d", i), payload)
	}
	errs := sendTogether(h, msgs...)
	for i, err := range errs {
		require.NoError(t, err, "message %d", i)
	}
	t.Logf("%d poisons in %d: %d handler calls, at most %d savepoints in one transaction, %d transactions with savepoints",
		poisons, n, len(bb.calls()), sc.most(), sc.txs)
	require.LessOrEqual(t, sc.most(), 32)
	require.Greater(t, sc.txs, 1, "the bisection went on in a fresh transaction")
	require.Equal(t, poisons, pgtest.Count(t, b.pool, `SELECT count(*) FROM inbox WHERE state = 'failed'`))
	require.Equal(t, n-poisons, pgtest.Count(t, b.pool, `SELECT count(*) FROM inbox WHERE state = 'completed'`))
	require.Equal(t, n-poisons, pgtest.Count(t, b.pool, `SELECT count(*) FROM biz`))
	require.Equal(t, n-poisons, pgtest.Count(t, b.pool, `SELECT count(DISTINCT key) FROM biz WHERE payload = 'ok'`))
}

// The savepoint path (here a message handler that replaces idem's transaction, seen
// only at the batch's COMMIT) runs a batch of 100 as transactions of at most 32
// savepoints each.
func TestSavepointPathStaysWithinTheSavepointBound(t *testing.T) {
	t.Parallel()
	const n = 100
	sc := &savepointCounter{}
	c, b := setup(t, consumer.GroupCommit, batched, countSavepoints(t, sc), func(cfg *consumer.Config) { cfg.Batch.MaxBatch = 128 })
	h := c.Middleware(b.bizHandler(func(msg *message.Message) error {
		if msg.UUID == "m-090" {
			_, err := consumer.Tx(msg.Context()).Exec(msg.Context(), "ROLLBACK; BEGIN")
			return err
		}
		return nil
	}))
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = newMsg(fmt.Sprintf("m-%03d", i), `{}`)
	}
	errs := sendTogether(middlewareFunc(h), msgs...)
	t.Logf("at most %d savepoints in one transaction, %d transactions with savepoints", sc.most(), sc.txs)
	require.LessOrEqual(t, sc.most(), 32)
	require.GreaterOrEqual(t, sc.txs, 3, "100 messages need at least 4 transactions of 32; the culprit's is rolled back")
	var nacked []*message.Message
	for i, err := range errs {
		key := fmt.Sprintf("m-%03d", i)
		if key == "m-090" {
			require.NoError(t, err)
			state, code := inboxState(t, b, key)
			require.Equal(t, "failed", state)
			require.Equal(t, "handler_ended_transaction", code)
			continue
		}
		requireAnswerMatchesInbox(t, b, key, err)
		if err != nil {
			nacked = append(nacked, newMsg(key, `{}`))
		}
	}
	require.NotEmpty(t, nacked, "the culprit's transaction held neighbours")
	require.Less(t, len(nacked), 32, "only the culprit's transaction's")
	// The redeliveries, together.
	for attempt := 0; len(nacked) > 0; attempt++ {
		require.Less(t, attempt, 5, "still failing: %d", len(nacked))
		errs := sendTogether(middlewareFunc(h), nacked...)
		var again []*message.Message
		for i, err := range errs {
			if err != nil {
				again = append(again, newMsg(nacked[i].UUID, `{}`))
			}
		}
		nacked = again
	}
	for i := range n {
		if key := fmt.Sprintf("m-%03d", i); key != "m-090" {
			require.Equal(t, 1, b.bizRows(t, key), key)
		}
	}
}

// A backend cut in the middle of a bisection (the batch's connection terminated
// while a half runs) loses nothing and commits nothing twice: every answer agrees
// with the inbox, and the redeliveries commit each innocent message once and
// record the poison one.
func TestBatchBisectionBackendCut(t *testing.T) {
	t.Parallel()
	for _, at := range []int{2, 3, 5} { // the handler call that cuts
		t.Run(fmt.Sprintf("call-%d", at), func(t *testing.T) {
			t.Parallel()
			h, bb, b := setupBatch(t, func(cfg *consumer.Config) { cfg.Batch.MaxBatch = 64 })
			var calls atomic.Int64
			bb.fail = func(msgs []*message.Message) error {
				for _, m := range msgs {
					if string(m.Payload) == "poison" {
						return consumer.Permanent(errors.New("poison in the batch"))
					}
				}
				return nil
			}
			cutting := bb.fail
			bb.fail = func(msgs []*message.Message) error {
				if calls.Add(1) == int64(at) {
					_, err := consumer.Tx(msgs[0].Context()).Exec(msgs[0].Context(), `SELECT pg_terminate_backend(pg_backend_pid())`)
					return err
				}
				return cutting(msgs)
			}
			const n = 20
			msgs := make([]*message.Message, n)
			for i := range msgs {
				payload := "ok"
				if i == 13 {
					payload = "poison"
				}
				msgs[i] = newMsg(fmt.Sprintf("m-%02d", i), payload)
			}
			errs := sendTogether(h, msgs...)
			for i, m := range msgs {
				requireAnswerMatchesInbox(t, b, m.UUID, errs[i])
			}
			require.Greater(t, calls.Load(), int64(at), "the bisection went on after the cut")
			for attempt := 0; ; attempt++ {
				var again []*message.Message
				for i, err := range errs {
					if err != nil {
						again = append(again, newMsg(msgs[i].UUID, string(msgs[i].Payload)))
					}
				}
				if len(again) == 0 {
					break
				}
				require.Less(t, attempt, 5, "still failing: %v", errs)
				errs = sendTogether(h, again...)
				msgs = again
			}
			state, _ := inboxState(t, b, "m-13")
			require.Equal(t, "failed", state)
			require.Equal(t, n-1, pgtest.Count(t, b.pool, `SELECT count(*) FROM biz`))
			require.Equal(t, n-1, pgtest.Count(t, b.pool, `SELECT count(DISTINCT key) FROM biz`))
			require.Equal(t, n-1, pgtest.Count(t, b.pool, `SELECT count(*) FROM inbox WHERE state = 'completed'`))
		})
	}
}
