package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/pgtest"
)

var modes = []consumer.Mode{consumer.Transactional, consumer.GroupCommit}

type bundle struct {
	pool   *pgxpool.Pool
	schema string
	reg    *prometheus.Registry
	calls  atomic.Int64
}

// setup makes a schema with a business table "biz" that has no unique constraint,
// so a double commit shows up as two rows.
func setup(t *testing.T, mode consumer.Mode, mutate ...func(*consumer.Config)) (*consumer.Consumer, *bundle) {
	t.Helper()
	pool, schema := pgtest.Setup(t)
	_, err := pool.Exec(context.Background(), `CREATE TABLE biz (id bigserial PRIMARY KEY, key text NOT NULL, payload text)`)
	require.NoError(t, err)
	b := &bundle{pool: pool, schema: schema, reg: prometheus.NewRegistry()}
	cfg := consumer.Config{
		Name: "payments", Pool: pool, Schema: schema, Mode: mode,
		LockTimeout: 2 * time.Second, BusyDelay: time.Millisecond, Registerer: b.reg,
	}
	for _, m := range mutate {
		m(&cfg)
	}
	c, err := consumer.New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return c, b
}

// leaseMode sets the lease to d in Lease mode; the other modes hold no lease, and
// refuse one.
func leaseMode(d time.Duration) func(*consumer.Config) {
	return func(cfg *consumer.Config) {
		if cfg.Mode == consumer.Lease {
			cfg.Lease = d
		}
	}
}

// bizHandler writes one business row and one email effect per message.
func (b *bundle) bizHandler(extra func(msg *message.Message) error) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		b.calls.Add(1)
		ctx := msg.Context()
		tx, err := consumer.TxSafely(ctx)
		if err != nil {
			return nil, err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO biz (key, payload) VALUES ($1, $2)`, msg.UUID, string(msg.Payload)); err != nil {
			return nil, err
		}
		if _, err := effects.Enqueue(ctx, tx, effects.Effect{Kind: "email", Key: "receipt:" + msg.UUID, Payload: msg.Payload}); err != nil {
			return nil, err
		}
		if extra != nil {
			return nil, extra(msg)
		}
		return nil, nil
	}
}

func (b *bundle) bizRows(t *testing.T, key string) int {
	return pgtest.Count(t, b.pool, `SELECT count(*) FROM biz WHERE key = $1`, key)
}

func (b *bundle) effectRows(t *testing.T) int {
	return pgtest.Count(t, b.pool, `SELECT count(*) FROM effects`)
}

func (b *bundle) counter(name string) float64 {
	mfs, _ := b.reg.Gather()
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			sum += m.GetCounter().GetValue()
		}
	}
	return sum
}

func newMsg(id, payload string) *message.Message {
	return message.NewMessage(id, []byte(payload))
}

func forModes(t *testing.T, fn func(t *testing.T, mode consumer.Mode)) {
	for _, mode := range modes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			fn(t, mode)
		})
	}
}

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
	if cfg.Mode == consumer.Lease {
		return // no batches, and a Batch is refused
	}
	cfg.Batch.MaxWait = 300 * time.Millisecond
	cfg.Batch.Workers = 1
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
	require.NotEmpty(t, inbox.Code(err), "%s: every nack has a stable code: %v", key, err)
}

func TestDeliveredTenTimesCommitsOnce(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, mode consumer.Mode) {
		c, b := setup(t, mode)
		h := c.Middleware(b.bizHandler(nil))
		for range 10 {
			out, err := h(newMsg("pay-1", `{"amount":10}`))
			require.NoError(t, err)
			require.Empty(t, out)
		}
		require.Equal(t, 1, b.bizRows(t, "pay-1"))
		require.Equal(t, 1, b.effectRows(t))
		require.EqualValues(t, 1, b.calls.Load())
		require.EqualValues(t, 9, b.counter("idem_inbox_duplicates_total"))
		require.EqualValues(t, 1, b.counter("idem_inbox_processed_total"))
	})
}

func TestOneKeyOnEightGoroutines(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, mode consumer.Mode) {
		c, b := setup(t, mode)
		h := c.Middleware(b.bizHandler(func(*message.Message) error {
			time.Sleep(100 * time.Millisecond) // hold the claim while the others arrive
			return nil
		}))
		var wg sync.WaitGroup
		errs := make([]error, 8)
		for i := range 8 {
			wg.Go(func() { _, errs[i] = h(newMsg("pay-8", `{"amount":8}`)) })
		}
		wg.Wait()
		for _, err := range errs {
			require.NoError(t, err)
		}
		require.Equal(t, 1, b.bizRows(t, "pay-8"))
		require.EqualValues(t, 1, b.calls.Load())
		require.EqualValues(t, 7, b.counter("idem_inbox_duplicates_total"))
	})
}

func TestWinnerFailsTransientlyWaiterTakesOver(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, mode consumer.Mode) {
		c, b := setup(t, mode)
		var first atomic.Bool
		h := c.Middleware(b.bizHandler(func(*message.Message) error {
			if first.CompareAndSwap(false, true) {
				time.Sleep(200 * time.Millisecond)
				return errors.New("provider timeout")
			}
			return nil
		}))
		var wg sync.WaitGroup
		var failed atomic.Int64
		for range 6 {
			wg.Go(func() {
				if _, err := h(newMsg("pay-t", `{}`)); err != nil {
					require.ErrorContains(t, err, "provider timeout")
					failed.Add(1)
				}
			})
		}
		wg.Wait()
		require.EqualValues(t, 1, failed.Load(), "only the winner's delivery is nacked")
		require.Equal(t, 1, b.bizRows(t, "pay-t"))
		require.EqualValues(t, 2, b.calls.Load(), "the winner and one waiter ran the handler")
	})
}

func TestTransientThenSuccess(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, mode consumer.Mode) {
		c, b := setup(t, mode)
		var n atomic.Int64
		h := c.Middleware(b.bizHandler(func(*message.Message) error {
			if n.Add(1) == 1 {
				return errors.New("deadline exceeded calling ledger")
			}
			return nil
		}))
		_, err := h(newMsg("pay-2", `{}`))
		require.Error(t, err)
		require.False(t, consumer.IsPermanent(err))
		require.Equal(t, 0, b.bizRows(t, "pay-2"), "a transient failure leaves nothing")
		require.Equal(t, 0, pgtest.Count(t, b.pool, `SELECT count(*) FROM inbox`), "a transient failure is never recorded")
		_, err = h(newMsg("pay-2", `{}`))
		require.NoError(t, err)
		require.EqualValues(t, 2, b.calls.Load())
		require.Equal(t, 1, b.bizRows(t, "pay-2"))
	})
}

func TestPermanentFailureRecordedAndReplayed(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, mode consumer.Mode) {
		var failures []consumer.Failure
		var mu sync.Mutex
		c, b := setup(t, mode, func(cfg *consumer.Config) {
			cfg.OnFailure = func(_ context.Context, f consumer.Failure) {
				mu.Lock()
				defer mu.Unlock()
				failures = append(failures, f)
			}
		})
		h := c.Middleware(b.bizHandler(func(*message.Message) error {
			return consumer.Permanent(errors.New("card declined"))
		}))
		_, err := h(newMsg("pay-3", `{}`))
		require.NoError(t, err, "AckOnPermanent acks after recording")
		require.Equal(t, 0, b.bizRows(t, "pay-3"), "business writes rolled back")
		require.Equal(t, 0, b.effectRows(t), "effects rolled back")
		var state, code string
		require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT state, error_code FROM inbox WHERE key = 'pay-3'`).Scan(&state, &code))
		require.Equal(t, "failed", state)
		require.Equal(t, "permanent", code)

		_, err = h(newMsg("pay-3", `{}`))
		require.NoError(t, err)
		require.EqualValues(t, 1, b.calls.Load(), "the redelivery did not run the handler")
		require.Len(t, failures, 2)
		require.False(t, failures[0].Replayed)
		require.True(t, failures[1].Replayed)
	})
}

func TestPermanentFailurePoisonPolicy(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, mode consumer.Mode) {
		c, b := setup(t, mode, func(cfg *consumer.Config) { cfg.PoisonOnPermanent = true })
		h := c.Middleware(b.bizHandler(func(*message.Message) error {
			return consumer.Permanent(errors.New("bad amount"))
		}))
		_, err := h(newMsg("pay-p", `{}`))
		var fe *consumer.FailedError
		require.ErrorAs(t, err, &fe)
		require.Equal(t, "pay-p", fe.Key)
		require.Equal(t, 1, pgtest.Count(t, b.pool, `SELECT count(*) FROM inbox WHERE state = 'failed'`))
		_, err = h(newMsg("pay-p", `{}`))
		require.NoError(t, err, "a recorded failure is acked on redelivery, not poisoned twice")
	})
}

func TestFingerprintMismatch(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, mode consumer.Mode) {
		c, b := setup(t, mode)
		h := c.Middleware(b.bizHandler(nil))
		_, err := h(newMsg("pay-4", `{"amount":10}`))
		require.NoError(t, err)
		_, err = h(newMsg("pay-4", `{"amount":99}`))
		require.ErrorIs(t, err, consumer.ErrFingerprintMismatch, "not acked as a duplicate")
		require.Equal(t, "fingerprint_mismatch", inbox.Code(err))
		require.EqualValues(t, 1, b.calls.Load(), "the handler did not run")
		require.Equal(t, 1, b.bizRows(t, "pay-4"))
		require.EqualValues(t, 1, b.counter("idem_inbox_fingerprint_mismatch_total"))
		require.EqualValues(t, 0, b.counter("idem_inbox_duplicates_total"))
	})
}

func TestLockTimeoutNacks(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, mode consumer.Mode) {
		c, b := setup(t, mode, func(cfg *consumer.Config) { cfg.LockTimeout = 100 * time.Millisecond })
		ctx := context.Background()
		// Another instance holds an uncommitted claim of the key.
		store, err := inboxdb.NewStore(b.schema)
		require.NoError(t, err)
		tx, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx)
		res, err := store.ClaimTx(ctx, tx, inboxdb.Claim{ID: inboxdb.ID{Consumer: "payments", Key: "pay-5"}, Fingerprint: mustFP(`{}`)})
		require.NoError(t, err)
		require.True(t, res.Claimed)

		h := c.Middleware(b.bizHandler(nil))
		_, err = h(newMsg("pay-5", `{}`))
		require.ErrorIs(t, err, consumer.ErrBusy)
		require.Contains(t, err.Error(), "lock timeout")
		require.EqualValues(t, 0, b.calls.Load())

		require.NoError(t, tx.Rollback(ctx))
		_, err = h(newMsg("pay-5", `{}`))
		require.NoError(t, err)
		require.Equal(t, 1, b.bizRows(t, "pay-5"))
	})
}

func mustFP(s string) []byte {
	fp, _ := inbox.SHA256([]byte(s))
	return fp
}

func TestBadInputIsTypedAndNeverDropped(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, mode consumer.Mode) {
		c, b := setup(t, mode)
		h := c.Middleware(b.bizHandler(nil))
		cases := []struct {
			id   string
			want error
		}{
			{"", consumer.ErrEmptyKey},
			{strings.Repeat("k", 10*1024), consumer.ErrKeyTooLong},
			{"bad-\xff-utf8", consumer.ErrKeyInvalid},
			{"nul-\x00", consumer.ErrKeyInvalid},
		}
		for _, tc := range cases {
			_, err := h(newMsg(tc.id, `{}`))
			require.ErrorIs(t, err, tc.want, "returned, so the message is nacked or poisoned, not acked")
			require.True(t, consumer.IsPermanent(err))
			require.NotEmpty(t, inbox.Code(err))
		}
		require.EqualValues(t, 0, b.calls.Load())
		require.EqualValues(t, len(cases), b.counter("idem_inbox_failed_total"))

		// Non-JSON under canonical JSON fingerprinting: the key is good, so the
		// failure is recorded under it.
		cj, b2 := setup(t, mode, func(cfg *consumer.Config) {
			cfg.Fingerprint = inbox.CanonicalJSON(inbox.JSONOptions{})
		})
		hj := cj.Middleware(b2.bizHandler(nil))
		_, err := hj(newMsg("pay-nj", `not json`))
		require.NoError(t, err)
		var code string
		require.NoError(t, b2.pool.QueryRow(context.Background(), `SELECT error_code FROM inbox WHERE key = 'pay-nj' AND state = 'failed'`).Scan(&code))
		require.Equal(t, "payload_not_json", code)
		require.EqualValues(t, 0, b2.calls.Load())

		// JSON that differs only in key order and whitespace is the same command.
		_, err = hj(newMsg("pay-j", `{"a":1,"b":[1,2]}`))
		require.NoError(t, err)
		_, err = hj(newMsg("pay-j", "{ \"b\": [1, 2],\n \"a\": 1.0 }"))
		require.NoError(t, err)
		require.EqualValues(t, 1, b2.calls.Load())
	})
}

// requireDatabaseUnavailable checks a nack for a Postgres that is unreachable or a
// connection that broke: coded database_unavailable, transient, the driver's error
// still inside it, and counted under its code.
func requireDatabaseUnavailable(t *testing.T, reg *prometheus.Registry, err error) {
	t.Helper()
	require.Error(t, err)
	require.ErrorIs(t, err, consumer.ErrDatabaseUnavailable)
	require.Equal(t, "database_unavailable", inbox.Code(err), "%v", err)
	require.False(t, consumer.IsPermanent(err))
	if reg != nil {
		require.Equal(t, 1.0, series(t, reg, "idem_inbox_nacked_total", map[string]string{"code": "database_unavailable"}))
	}
}

func TestUnreachablePostgresNacks(t *testing.T) {
	t.Parallel()
	forAllModes(t, func(t *testing.T, mode consumer.Mode) {
		cfg, err := pgxpool.ParseConfig("postgres://postgres@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=1")
		require.NoError(t, err)
		pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
		require.NoError(t, err)
		defer pool.Close()
		reg := prometheus.NewRegistry()
		// Skipped, New's check would fail after its timeout (schemacheck's
		// TestUnreachableDatabase): here Postgres is gone after the start.
		c, err := consumer.New(consumer.Config{Name: "x", Pool: pool, Mode: mode, Registerer: reg, SkipSchemaCheck: true})
		require.NoError(t, err)
		defer func() { require.NoError(t, c.Close()) }()
		var calls atomic.Int64
		h := c.Middleware(func(*message.Message) ([]*message.Message, error) {
			calls.Add(1)
			return nil, nil
		})
		_, err = h(newMsg("k", `{}`))
		requireDatabaseUnavailable(t, reg, err)
		var connectErr *pgconn.ConnectError
		require.ErrorAs(t, err, &connectErr, "the driver's error is kept")
		require.Zero(t, calls.Load())
	})
}

func TestConnectionKilledMidTransaction(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, mode consumer.Mode) {
		c, b := setup(t, mode)
		var killed atomic.Bool
		h := c.Middleware(b.bizHandler(func(msg *message.Message) error {
			if killed.CompareAndSwap(false, true) {
				// Cut this very backend, as a failover or a network cut would.
				_, err := consumer.Tx(msg.Context()).Exec(msg.Context(), `SELECT pg_terminate_backend(pg_backend_pid())`)
				return err
			}
			return nil
		}))
		_, err := h(newMsg("pay-k", `{}`))
		requireDatabaseUnavailable(t, b.reg, err)
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr, "the driver's error is kept")
		require.Equal(t, "57P01", pgErr.Code)
		require.Equal(t, 0, b.bizRows(t, "pay-k"))
		require.Equal(t, 0, pgtest.Count(t, b.pool, `SELECT count(*) FROM inbox`), "nothing recorded")
		_, err = h(newMsg("pay-k", `{}`))
		require.NoError(t, err)
		require.Equal(t, 1, b.bizRows(t, "pay-k"))
	})
}

// The server ends a session that idles in a transaction past
// idle_in_transaction_session_timeout (FATAL 25P03): the delivery is nacked as
// database_unavailable, nothing commits, and the redelivery does.
func TestIdleInTransactionTimeoutNacks(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, mode consumer.Mode) {
		c, b := setup(t, mode)
		var slow atomic.Bool
		slow.Store(true)
		h := c.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			tx := consumer.Tx(ctx)
			if slow.CompareAndSwap(true, false) {
				if _, err := tx.Exec(ctx, `SET LOCAL idle_in_transaction_session_timeout = '50ms'`); err != nil {
					return nil, err
				}
				time.Sleep(500 * time.Millisecond) // a slow call made with the transaction open
			}
			_, err := tx.Exec(ctx, `INSERT INTO biz (key, payload) VALUES ($1, $2)`, msg.UUID, string(msg.Payload))
			return nil, err
		})
		_, err := h(newMsg("pay-idle", `{}`))
		requireDatabaseUnavailable(t, b.reg, err)
		require.Equal(t, 0, b.bizRows(t, "pay-idle"))
		require.Equal(t, 0, pgtest.Count(t, b.pool, `SELECT count(*) FROM inbox`), "nothing recorded")
		_, err = h(newMsg("pay-idle", `{}`))
		require.NoError(t, err)
		require.Equal(t, 1, b.bizRows(t, "pay-idle"))
	})
}

func TestTenantsAreSeparateOperations(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, mode consumer.Mode) {
		c, b := setup(t, mode, func(cfg *consumer.Config) { cfg.Tenant = consumer.MetadataKey("tenant") })
		h := c.Middleware(b.bizHandler(nil))
		for _, tenant := range []string{"acme", "globex", "acme"} {
			m := newMsg("order-1", `{}`)
			m.Metadata.Set("tenant", tenant)
			_, err := h(m)
			require.NoError(t, err)
		}
		require.EqualValues(t, 2, b.calls.Load())
		require.Equal(t, 2, pgtest.Count(t, b.pool, `SELECT count(*) FROM inbox WHERE key = 'order-1'`))
	})
}

func TestMissingSchemaFailsClearly(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.Setup(t, pgtest.Options{NoMigrate: true})
	// Skipped, New's check would refuse the schema (TestNewChecksTheSchema): the
	// first message finds it missing instead.
	c, err := consumer.New(consumer.Config{Name: "x", Pool: pool, Schema: schema, SkipSchemaCheck: true})
	require.NoError(t, err)
	h := c.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	_, err = h(newMsg("k", `{}`))
	require.ErrorIs(t, err, consumer.ErrSchemaMissing)
	require.Contains(t, err.Error(), "idem migrate up")
}

func TestInvalidConfig(t *testing.T) {
	t.Parallel()
	_, err := consumer.New(consumer.Config{})
	require.ErrorContains(t, err, "invalid config: Pool is required")
	_, err = consumer.New(consumer.Config{Pool: &pgxpool.Pool{}, Schema: "Robert'); DROP TABLE"})
	require.ErrorIs(t, err, inbox.ErrInvalidSchema)
}

var _ = fmt.Sprintf
var _ = pgx.ErrNoRows

// Under REPEATABLE READ a claim that waited for a concurrent winner gets a
// serialization failure (40001) instead of seeing the winner's row. It must be a
// nack, never a permanent failure, and the redelivery is a duplicate.
func TestRepeatableReadConflictIsTransient(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, mode consumer.Mode) {
		c, b := setup(t, mode, func(cfg *consumer.Config) { cfg.IsoLevel = pgx.RepeatableRead })
		h := c.Middleware(b.bizHandler(func(*message.Message) error {
			time.Sleep(100 * time.Millisecond)
			return nil
		}))
		var wg sync.WaitGroup
		errs := make([]error, 4)
		for i := range errs {
			wg.Go(func() { _, errs[i] = h(newMsg("rr", `{}`)) })
		}
		wg.Wait()
		serialization := 0
		for _, err := range errs {
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == "40001" {
				serialization++
			}
		}
		if mode == consumer.Transactional {
			require.Positive(t, serialization, "the waiters saw 40001: %v", errs)
		}
		for _, err := range errs {
			if err != nil {
				require.False(t, consumer.IsPermanent(err), "a serialization failure is transient: %v", err)
				// The broker redelivers; now the committed row is visible.
				_, err = h(newMsg("rr", `{}`))
				require.NoError(t, err)
			}
		}
		require.Equal(t, 1, b.bizRows(t, "rr"))
		require.Equal(t, 0, pgtest.Count(t, b.pool, `SELECT count(*) FROM inbox WHERE state = 'failed'`))
	})
}
