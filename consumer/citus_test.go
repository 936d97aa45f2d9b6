package consumer_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/pgtest"
)

// citusLedger is a schema on the Citus coordinator migrated in Citus mode, with a
// user's business table, ledger, distributed by tenant and colocated with idem's
// tables, as docs/citus.md has it.
func citusLedger(t *testing.T) (*pgxpool.Pool, string) {
	t.Helper()
	pool, schema := pgtest.CitusSetup(t, pgtest.Options{MaxConns: 8})
	_, err := pool.Exec(context.Background(), `CREATE TABLE ledger (
		tenant text NOT NULL, key text NOT NULL, payload text,
		PRIMARY KEY (tenant, key))`)
	require.NoError(t, err)
	pgtest.Distribute(t, pool, schema, "ledger")
	return pool, schema
}

// citusMsg is a message of tenant (metadata "tenant").
func citusMsg(tenant, id string) *message.Message {
	m := message.NewMessage(tenant+"-"+id, []byte(`{"n":1}`))
	m.Metadata.Set("tenant", tenant)
	return m
}

// On Citus, each mode (and the batch handler) commits each message's ledger row,
// inbox key and effect once, on the worker that holds its tenant, with messages
// of three tenants delivered together (group-commit batches that mix them) and
// then all delivered again; a permanent failure is recorded as failed.
func TestCitusEveryMode(t *testing.T) {
	t.Parallel()
	pool, schema := citusLedger(t)
	type run struct {
		name  string
		mode  consumer.Mode
		batch bool
	}
	for _, r := range []run{
		{"transactional", consumer.Transactional, false},
		{"group-commit", consumer.GroupCommit, false},
		{"lease", consumer.Lease, false},
		{"batch-handler", consumer.GroupCommit, true},
	} {
		t.Run(r.name, func(t *testing.T) {
			var batch consumer.BatchConfig // Lease mode has no batches
			if r.mode != consumer.Lease {
				batch = consumer.BatchConfig{MaxBatch: 12, MaxWait: 300 * time.Millisecond, Workers: 1}
			}
			c, err := consumer.New(consumer.Config{Name: r.name, Pool: pool, Schema: schema, Mode: r.mode,
				Tenant: consumer.MetadataKey("tenant"), Batch: batch,
				LockTimeout: 5 * time.Second, Registerer: prometheus.NewRegistry()})
			require.NoError(t, err)
			defer func() { require.NoError(t, c.Close()) }()
			write := func(ctx context.Context, tx pgx.Tx, m *message.Message) error {
				if m.UUID[2:] == "bad" {
					return consumer.Permanent(errors.New("bad"))
				}
				tenant := m.Metadata.Get("tenant")
				if _, err := tx.Exec(ctx, `INSERT INTO ledger (tenant, key, payload) VALUES ($1, $2, $3)`,
					tenant, r.name+":"+m.UUID, string(m.Payload)); err != nil {
					return err
				}
				_, err := effects.Enqueue(ctx, tx, effects.Effect{Kind: "email", Key: r.name + ":" + m.UUID, Payload: m.Payload})
				return err
			}
			var h func(*message.Message) error
			if r.batch {
				bh := c.HandleBatch(func(ctx context.Context, tx pgx.Tx, msgs []*message.Message) error {
					var errs []error
					for _, m := range msgs {
						if err := write(ctx, tx, m); err != nil {
							if consumer.IsPermanent(err) {
								errs = append(errs, consumer.ForMessage(m, err))
								continue
							}
							return err
						}
					}
					return errors.Join(errs...)
				})
				h = func(m *message.Message) error { return bh(m) }
			} else {
				mw := c.Middleware(func(m *message.Message) ([]*message.Message, error) {
					return nil, write(m.Context(), consumer.Tx(m.Context()), m)
				})
				h = func(m *message.Message) error { _, err := mw(m); return err }
			}
			var msgs []*message.Message
			for _, tenant := range []string{"a", "b", "c"} {
				for _, id := range []string{"1", "2", "3", "bad"} {
					msgs = append(msgs, citusMsg(tenant, id))
				}
			}
			for round := range 2 {
				var wg sync.WaitGroup
				errs := make([]error, len(msgs))
				for i, m := range msgs {
					wg.Go(func() { errs[i] = h(m.Copy()) })
				}
				wg.Wait()
				for i, err := range errs {
					if msgs[i].UUID[2:] == "bad" {
						continue // recorded as failed, or nacked; the rows say which
					}
					require.NoError(t, err, "round %d, message %s", round, msgs[i].UUID)
				}
			}
			require.Equal(t, 9, pgtest.Count(t, pool, `SELECT count(*) FROM ledger WHERE key LIKE $1`, r.name+":%"))
			require.Equal(t, 9, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE consumer = $1 AND state = 'completed'`, r.name))
			require.Equal(t, 3, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE consumer = $1 AND state = 'failed' AND key LIKE '%bad'`, r.name))
			require.Equal(t, 9, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE key LIKE $1 AND key LIKE '%' || tenant || '-%'`, r.name+":%"))
			// Each tenant's rows are on one worker, the same for all three tables.
			require.Equal(t, 3, pgtest.Count(t, pool, `SELECT count(DISTINCT tenant) FROM ledger WHERE key LIKE $1`, r.name+":%"))
		})
	}
}

// On Citus, LockTimeout bounds the claim's wait for a key another transaction
// holds on a worker (citus_lock_waits shows the wait, then shows it gone), and
// the delivery is nacked as busy; once the holder rolls back, the redelivery
// commits.
func TestCitusLockTimeoutReachesTheWorker(t *testing.T) {
	t.Parallel()
	pool, schema := citusLedger(t)
	ctx := context.Background()
	for _, mode := range []consumer.Mode{consumer.Transactional, consumer.GroupCommit} {
		t.Run(mode.String(), func(t *testing.T) {
			name := "lock-" + mode.String()
			c, err := consumer.New(consumer.Config{Name: name, Pool: pool, Schema: schema, Mode: mode,
				Tenant: consumer.MetadataKey("tenant"), LockTimeout: 3 * time.Second,
				Registerer: prometheus.NewRegistry()})
			require.NoError(t, err)
			defer func() { require.NoError(t, c.Close()) }()
			store, err := inboxdb.NewStore(schema)
			require.NoError(t, err)
			holder, err := pool.Begin(ctx)
			require.NoError(t, err)
			defer func() { _ = holder.Rollback(ctx) }()
			res, err := store.ClaimTx(ctx, holder, inboxdb.Claim{ID: inboxdb.ID{Consumer: name, Tenant: "a", Key: "a-1"},
				Fingerprint: mustFP(`{"n":1}`)})
			require.NoError(t, err)
			require.True(t, res.Claimed)

			h := c.Middleware(func(m *message.Message) ([]*message.Message, error) {
				_, err := consumer.Tx(m.Context()).Exec(m.Context(), `INSERT INTO ledger (tenant, key) VALUES ($1, $2)`, "a", name)
				return nil, err
			})
			// Without the bound on the worker, the claim would wait for the holder
			// until this context ends.
			mctx, cancel := context.WithTimeout(ctx, 20*time.Second)
			defer cancel()
			m := citusMsg("a", "1")
			m.SetContext(mctx)
			done := make(chan error, 1)
			go func() { _, err := h(m); done <- err }()
			// citus_lock_waits shows the claim waiting (on the worker that holds the
			// key: the coordinator's pg_stat_activity does not show it).
			lockWaits := `SELECT count(*) FROM citus_lock_waits WHERE blocked_statement LIKE '%' || $1 || '%inbox%'`
			pgtest.WaitFor(t, 3*time.Second, "the claim waiting for the held key", func() bool {
				return pgtest.Count(t, pool, lockWaits, schema) == 1
			})
			var err2 error
			select {
			case err2 = <-done:
			case <-mctx.Done():
				t.Fatal("the claim was still waiting for the holder's lock when the message's context ended")
			}
			require.ErrorIs(t, err2, consumer.ErrBusy)
			require.Contains(t, err2.Error(), "lock timeout")
			require.Zero(t, pgtest.Count(t, pool, lockWaits, schema), "the wait ended on the worker")
			require.NoError(t, holder.Rollback(ctx))
			_, err = h(citusMsg("a", "1"))
			require.NoError(t, err)
			require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM ledger WHERE tenant = 'a' AND key = $1`, name))
		})
	}
}

// On Citus, a group-commit batch whose handler sends COMMIT itself is caught by
// the commit guard (on the coordinator, where idem's COMMIT goes): nothing of the
// culprit's transaction is committed on the worker, and the handler's later writes
// are the only rows it leaves.
func TestCitusCommitGuardCatchesAHandlersCommit(t *testing.T) {
	t.Parallel()
	pool, schema := citusLedger(t)
	c, err := consumer.New(consumer.Config{Name: "guard", Pool: pool, Schema: schema, Mode: consumer.GroupCommit,
		Tenant: consumer.MetadataKey("tenant"), Batch: consumer.BatchConfig{MaxBatch: 3, MaxWait: 300 * time.Millisecond, Workers: 1},
		Registerer: prometheus.NewRegistry()})
	require.NoError(t, err)
	defer func() { require.NoError(t, c.Close()) }()
	h := c.Middleware(func(m *message.Message) ([]*message.Message, error) {
		ctx := m.Context()
		tx := consumer.Tx(ctx)
		if _, err := tx.Exec(ctx, `INSERT INTO ledger (tenant, key) VALUES ('a', $1)`, m.UUID); err != nil {
			return nil, err
		}
		if m.UUID == "a-k" {
			_, _ = tx.Exec(ctx, "COMMIT")
		}
		return nil, nil
	})
	var wg sync.WaitGroup
	for _, id := range []string{"1", "k", "z"} {
		wg.Go(func() { _, _ = h(citusMsg("a", id)) })
	}
	wg.Wait()
	// The culprit's COMMIT failed at the guard, so nothing it wrote before it
	// committed; the neighbours ran again and committed once.
	require.Equal(t, 0, pgtest.Count(t, pool, `SELECT count(*) FROM ledger WHERE tenant = 'a' AND key = 'a-k'`))
	require.Equal(t, 0, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE consumer = 'guard' AND key = 'a-k' AND state = 'completed'`))
	for _, id := range []string{"1", "z"} {
		_, err := h(citusMsg("a", id)) // a duplicate if it committed already
		require.NoError(t, err, id)
		require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM ledger WHERE tenant = 'a' AND key = $1`, "a-"+id))
	}
	require.Equal(t, 2, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE consumer = 'guard' AND state = 'completed'`))
}

// On Citus, in Transactional mode, a handler that ends idem's transaction and
// begins another (COMMIT; BEGIN) is caught by the mark's check in idem's COMMIT:
// what it wrote in its second transaction is rolled back, and the key is
// reported as handler_ended_transaction.
func TestCitusTransactionalCatchesAHandlersCommit(t *testing.T) {
	t.Parallel()
	pool, schema := citusLedger(t)
	var codes []string
	var mu sync.Mutex
	c, err := consumer.New(consumer.Config{Name: "ended", Pool: pool, Schema: schema, Mode: consumer.Transactional,
		Tenant: consumer.MetadataKey("tenant"), Registerer: prometheus.NewRegistry(),
		OnFailure: func(_ context.Context, f consumer.Failure) {
			mu.Lock()
			codes = append(codes, f.Code)
			mu.Unlock()
		}})
	require.NoError(t, err)
	defer func() { require.NoError(t, c.Close()) }()
	h := c.Middleware(func(m *message.Message) ([]*message.Message, error) {
		ctx := m.Context()
		tx := consumer.Tx(ctx)
		_, _ = tx.Exec(ctx, "COMMIT; BEGIN")
		_, err := tx.Exec(ctx, `INSERT INTO ledger (tenant, key) VALUES ('a', 'after')`)
		return nil, err
	})
	_, err = h(citusMsg("a", "k"))
	require.NoError(t, err, "recorded, and acked")
	require.Zero(t, pgtest.Count(t, pool, `SELECT count(*) FROM ledger WHERE tenant = 'a' AND key = 'after'`))
	mu.Lock()
	require.Equal(t, []string{"handler_ended_transaction"}, codes)
	mu.Unlock()
}

// On Citus a group-commit batch, and a batch handler's, commit with one phase:
// its claims, failures and effects are single-row statements that Citus routes to
// the tenant's worker, where INSERT … SELECT FROM unnest(…) would run through the
// coordinator and commit with two-phase commit (PREPARE TRANSACTION on the worker)
// whatever the batch. The pool logs the commands Citus sends to the workers
// (citus.log_remote_commands, as notices), and none is a PREPARE TRANSACTION,
// while each message's ledger row, inbox key and effect commit once and a
// permanent failure is recorded.
func TestCitusBatchesCommitInOnePhase(t *testing.T) {
	t.Parallel()
	base, schema := citusLedger(t)
	pool, remote := pgtest.CitusRemoteLog(t, base)
	issued := func() int64 { return remote.Count("issuing ") }
	prepared := func() int64 { return remote.Count("PREPARE TRANSACTION") }
	for _, batchHandler := range []bool{false, true} {
		name := "group-commit"
		if batchHandler {
			name = "batch-handler"
		}
		t.Run(name, func(t *testing.T) {
			c, err := consumer.New(consumer.Config{Name: name, Pool: pool, Schema: schema, Mode: consumer.GroupCommit,
				Tenant:     consumer.MetadataKey("tenant"),
				Batch:      consumer.BatchConfig{MaxBatch: 8, MaxWait: 300 * time.Millisecond, Workers: 1},
				Registerer: prometheus.NewRegistry()})
			require.NoError(t, err)
			defer func() { require.NoError(t, c.Close()) }()
			write := func(ctx context.Context, tx pgx.Tx, m *message.Message) error {
				if m.UUID == "a-bad" {
					return consumer.Permanent(errors.New("bad"))
				}
				if _, err := tx.Exec(ctx, `INSERT INTO ledger (tenant, key) VALUES ('a', $1)`, name+":"+m.UUID); err != nil {
					return err
				}
				_, err := effects.Enqueue(ctx, tx, effects.Effect{Kind: "email", Key: name + ":" + m.UUID, Payload: m.Payload})
				return err
			}
			h := func(m *message.Message) error {
				_, err := c.Middleware(func(m *message.Message) ([]*message.Message, error) {
					return nil, write(m.Context(), consumer.Tx(m.Context()), m)
				})(m)
				return err
			}
			if batchHandler {
				bh := c.HandleBatch(func(ctx context.Context, tx pgx.Tx, msgs []*message.Message) error {
					var errs []error
					for _, m := range msgs {
						if err := write(ctx, tx, m); err != nil {
							errs = append(errs, consumer.ForMessage(m, err))
						}
					}
					return errors.Join(errs...)
				})
				h = func(m *message.Message) error { return bh(m) }
			}
			ids := []string{"1", "2", "3", "4", "5", "bad"}
			before := prepared()
			for round := range 2 { // the second round is all duplicates
				var wg sync.WaitGroup
				errs := make([]error, len(ids))
				for i, id := range ids {
					wg.Go(func() { errs[i] = h(citusMsg("a", id)) })
				}
				wg.Wait()
				for i, id := range ids {
					// A permanent failure is recorded, and its message acknowledged.
					require.NoError(t, errs[i], "round %d: %s", round, id)
				}
			}
			require.Equal(t, 5, pgtest.Count(t, pool, `SELECT count(*) FROM ledger WHERE key LIKE $1`, name+":%"))
			require.Equal(t, 5, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE key LIKE $1`, name+":%"))
			require.Equal(t, 5, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE consumer = $1 AND state = 'completed'`, name))
			require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE consumer = $1 AND state = 'failed'`, name))
			require.Positive(t, issued(), "the pool logs what Citus sends to the workers")
			require.Equal(t, before, prepared(), "a batch committed with two-phase commit")
		})
	}
}

// On Citus, a handler's Enqueue (Transactional mode) writes its row with one
// insert that Citus routes to the tenant's worker as it is, and raises the
// dispatchers' notification on the coordinator: no intermediate result is
// copied to or from a worker, and a LISTEN on the coordinator hears it. A
// duplicate writes nothing and notifies nothing.
func TestCitusEnqueueIsRoutedAsItIs(t *testing.T) {
	t.Parallel()
	base, schema := citusLedger(t)
	pool, remote := pgtest.CitusRemoteLog(t, base)
	ctx := context.Background()
	listener, err := base.Acquire(ctx)
	require.NoError(t, err)
	defer listener.Release()
	_, err = listener.Exec(ctx, "LISTEN idem_effects")
	require.NoError(t, err)

	c, err := consumer.New(consumer.Config{Name: "routed", Pool: pool, Schema: schema,
		Tenant: consumer.MetadataKey("tenant"), Registerer: prometheus.NewRegistry()})
	require.NoError(t, err)
	defer func() { require.NoError(t, c.Close()) }()
	h := c.Middleware(func(m *message.Message) ([]*message.Message, error) {
		ctx := m.Context()
		_, err := effects.Enqueue(ctx, consumer.Tx(ctx), effects.Effect{Kind: "email", Key: "receipt:" + m.UUID, Payload: m.Payload})
		return nil, err
	})
	_, err = h(citusMsg("a", "1"))
	require.NoError(t, err)
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE tenant = 'a' AND key = 'receipt:a-1'`))
	require.Positive(t, remote.Count("issuing "), "the pool logs what Citus sends to the workers")
	require.Zero(t, remote.Count("read_intermediate_result"), "the enqueue went through the coordinator's recursive planning")
	require.Zero(t, remote.Count("format result"), "the enqueue went through the coordinator's recursive planning")
	// ours waits for a notification of this schema (other tests' notifications
	// on the channel name theirs).
	ours := func(within time.Duration) error {
		wctx, cancel := context.WithTimeout(ctx, within)
		defer cancel()
		for {
			n, err := listener.Conn().WaitForNotification(wctx)
			if err != nil || n.Payload == schema {
				return err
			}
		}
	}
	require.NoError(t, ours(10*time.Second), "the enqueue's notification")

	// A duplicate delivery enqueues nothing, and raises nothing.
	_, err = h(citusMsg("a", "1"))
	require.NoError(t, err)
	require.ErrorIs(t, ours(time.Second), context.DeadlineExceeded, "a duplicate raised a notification")
}
