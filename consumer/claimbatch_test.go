package consumer

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/internal/text"
)

// countingTx counts the statements (and pipelines) a store sends through it.
type countingTx struct {
	pgx.Tx
	sent atomic.Int64
}

func (c *countingTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	c.sent.Add(1)
	return c.Tx.Query(ctx, sql, args...)
}

func (c *countingTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	c.sent.Add(1)
	return c.Tx.QueryRow(ctx, sql, args...)
}

func (c *countingTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	c.sent.Add(1)
	return c.Tx.Exec(ctx, sql, args...)
}

func (c *countingTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	c.sent.Add(1)
	return c.Tx.SendBatch(ctx, b)
}

// testStores is the inbox store and the batch claimer on one schema.
type testStores struct {
	*inboxdb.Store
	*batchStore
}

func newTestStores(schema string) (*testStores, error) {
	store, err := inboxdb.NewStore(schema)
	if err != nil {
		return nil, err
	}
	return &testStores{Store: store, batchStore: newBatchStore(schema)}, nil
}

// setupStores is testStores on a fresh schema, and a pool on it.
func setupStores(t *testing.T) (*testStores, *pgxpool.Pool) {
	t.Helper()
	t.Parallel()
	pool, schema := pgtest.Setup(t)
	store, err := newTestStores(schema)
	require.NoError(t, err)
	return store, pool
}

func claimOf(key string, fp string) inboxdb.Claim {
	return inboxdb.Claim{ID: inboxdb.ID{Consumer: "c", Key: key}, Fingerprint: []byte(fp)}
}

func batchOf(keys ...string) []batchClaim {
	out := make([]batchClaim, len(keys))
	for i, k := range keys {
		out[i] = batchClaim{Claim: claimOf(k, "fp")}
	}
	return out
}

// One statement claims the new keys and reads the committed rows of the others:
// a redelivery of a long-committed key costs no second statement. Results come back
// in the caller's order, whatever order the keys were claimed in. Mixed: each batch
// also holds a new key of another tenant, so the statements' forms for several
// tenants run instead of the one-tenant ones.
//
// Its form for Citus (each: one single-row claim a key, pipelined with the
// prelude in the same round trip) gives the same answers; the rows its claims met
// are read by one more statement.
func TestClaimBatchTx(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ mixed, each bool }{{false, false}, {true, false}, {false, true}} {
		t.Run(fmt.Sprintf("mixed tenants %v, each %v", c.mixed, c.each), func(t *testing.T) { testClaimBatchTx(t, c.mixed, c.each) })
	}
}

func testClaimBatchTx(t *testing.T, mixed, each bool) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.Setup(t)
	store, err := newTestStores(schema)
	require.NoError(t, err)

	round := 0
	claim := func(claims []batchClaim) (res []inboxdb.ClaimResult, statements int64) {
		t.Helper()
		n := len(claims)
		if mixed && n > 0 {
			round++
			claims = append(claims, batchClaim{Claim: inboxdb.Claim{
				ID: inboxdb.ID{Consumer: "c", Tenant: "t2", Key: fmt.Sprint("other-", round)}, Fingerprint: []byte("fp")}})
		}
		require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) (err error) {
			ct := &countingTx{Tx: tx}
			res, err = store.ClaimBatchTx(ctx, ct, []string{"SET LOCAL lock_timeout = 2000"}, claims, each)
			statements = ct.sent.Load()
			return err
		}))
		if mixed && n > 0 {
			require.True(t, res[n].Claimed, "the other tenant's new key")
		}
		return res[:n], statements
	}

	res, n := claim(batchOf("k3", "k1", "k2"))
	require.EqualValues(t, 1, n, "the prelude and the claim travel in one round trip")
	for _, r := range res {
		require.True(t, r.Claimed)
	}
	require.Equal(t, 3, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE state = 'completed' AND tenant = ''`))

	claims := batchOf("k4", "k2", "k1", "k5")
	claims[1].Fingerprint = []byte("other")
	claims[3].Failed, claims[3].Code, claims[3].Error = true, "card_declined", "declined\x00\xff"
	res, n = claim(claims)
	if each {
		require.EqualValues(t, 2, n, "the rows the claims met are read by one more statement")
	} else {
		require.EqualValues(t, 1, n, "committed rows are read by the claim itself")
	}
	require.True(t, res[0].Claimed, "k4 is new")
	require.False(t, res[1].Claimed)
	require.True(t, res[1].Mismatch, "k2 came with another payload")
	require.Equal(t, inboxdb.StateCompleted, res[1].Existing.State)
	require.False(t, res[2].Claimed)
	require.False(t, res[2].Mismatch, "k1 is a duplicate")
	require.Equal(t, "k1", res[2].Existing.Key)
	require.NotNil(t, res[2].Existing.CompletedAt)
	require.True(t, res[3].Claimed, "k5's failure is recorded")
	var state, code, msg string
	var group []byte
	require.NoError(t, pool.QueryRow(ctx, `SELECT state, error_code, error, error_group FROM inbox WHERE key = 'k5'`).Scan(&state, &code, &msg, &group))
	require.Equal(t, "failed", state)
	require.Equal(t, "card_declined", code)
	require.Equal(t, text.Sanitize("declined\x00\xff", 0), msg)
	require.NotEmpty(t, group, "a failure keeps its group")

	// A recorded failure is replayed to a later claim of the key.
	res, _ = claim(batchOf("k5"))
	require.False(t, res[0].Claimed)
	require.Equal(t, inboxdb.StateFailed, res[0].Existing.State)
	require.Equal(t, "card_declined", res[0].Existing.ErrorCode)

	// Only the prelude, when nothing is to be claimed.
	res, n = claim(nil)
	require.Empty(t, res)
	require.EqualValues(t, 1, n)

	_, err = store.ClaimBatchTx(ctx, &countingTx{}, nil, batchOf("a", "b", "a"), false)
	require.ErrorContains(t, err, "twice")
	_, err = store.ClaimBatchTx(ctx, &countingTx{}, nil, batchOf("a", ""), false)
	require.ErrorIs(t, err, inbox.ErrEmptyKey)
}

// A key that another transaction holds uncommitted makes the claim wait. If that
// transaction commits, one more statement (a new snapshot) reads its row; if it
// rolls back, the batch owns the key.
//
// A batch of one tenant's keys uses the statements' one-tenant forms, a batch of
// several tenants the others (mixed): both are run.
func TestClaimBatchTxWaitsForConcurrentClaimers(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ commit, mixed, each bool }{{true, false, false}, {false, false, false}, {true, true, false}, {false, true, false},
		{true, false, true}, {false, false, true}} {
		commit := c.commit
		t.Run(fmt.Sprintf("other commits %v, mixed tenants %v, each %v", commit, c.mixed, c.each), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool, schema := pgtest.Setup(t)
			store, err := newTestStores(schema)
			require.NoError(t, err)
			other, err := pool.Begin(ctx)
			require.NoError(t, err)
			defer other.Rollback(ctx)
			for _, k := range []string{"k1", "k3"} {
				res, err := store.ClaimTx(ctx, other, claimOf(k, "fp"))
				require.NoError(t, err)
				require.True(t, res.Claimed)
			}

			type answer struct {
				res []inboxdb.ClaimResult
				n   int64
				err error
			}
			done := make(chan answer, 1)
			go func() {
				var a answer
				a.err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) (err error) {
					ct := &countingTx{Tx: tx}
					claims := batchOf("k0", "k1", "k2", "k3")
					if c.mixed {
						claims = append(claims, batchClaim{Claim: inboxdb.Claim{ID: inboxdb.ID{Consumer: "c", Tenant: "t2", Key: "k1"}, Fingerprint: []byte("fp")}})
					}
					a.res, err = store.ClaimBatchTx(ctx, ct, []string{"SET LOCAL lock_timeout = 30000"}, claims, c.each)
					a.n = ct.sent.Load()
					return err
				})
				done <- a
			}()
			// The batch waits for the other transaction's key.
			pgtest.WaitFor(t, 30*time.Second, "the batch claim to wait on the lock", func() bool {
				return pgtest.Count(t, pool, `SELECT count(*) FROM pg_stat_activity
					WHERE wait_event_type = 'Lock' AND query LIKE '%INSERT INTO%inbox%' AND application_name = $1`, "idem-test:"+schema) > 0
			})
			select {
			case a := <-done:
				t.Fatalf("the claim did not wait: %+v", a)
			default:
			}
			if commit {
				require.NoError(t, other.Commit(ctx))
			} else {
				require.NoError(t, other.Rollback(ctx))
			}
			var a answer
			select {
			case a = <-done:
			case <-time.After(60 * time.Second):
				t.Fatal("the claim never returned")
			}
			require.NoError(t, a.err)
			require.True(t, a.res[0].Claimed)
			require.True(t, a.res[2].Claimed)
			if commit {
				require.EqualValues(t, 2, a.n, "the rows the claim waited for are read by a second statement")
				for _, i := range []int{1, 3} {
					require.False(t, a.res[i].Claimed)
					require.False(t, a.res[i].Mismatch)
					require.Equal(t, inboxdb.StateCompleted, a.res[i].Existing.State)
				}
			} else {
				require.EqualValues(t, 1, a.n)
				require.True(t, a.res[1].Claimed)
				require.True(t, a.res[3].Claimed)
			}
			want := 4
			if c.mixed {
				require.True(t, a.res[4].Claimed, "another tenant's key k1 is its own")
				want++
			}
			require.Equal(t, want, pgtest.Count(t, pool, `SELECT count(*) FROM inbox`))
		})
	}
}

// Two batches that share keys, given them in opposite orders, claim them in one
// order, so neither fails on a deadlock. A third transaction holds the middle key
// until both batches wait for it: claimed in the order given, one batch would hold
// "z" and the other "a" by then, and each would next wait for the other's key.
func TestClaimBatchTxSortsKeysSoBatchesCannotDeadlock(t *testing.T) {
	t.Parallel()
	for _, each := range []bool{false, true} {
		t.Run(fmt.Sprintf("each %v", each), func(t *testing.T) { testClaimBatchTxSortsKeys(t, each) })
	}
}

func testClaimBatchTxSortsKeys(t *testing.T, each bool) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.Setup(t)
	store, err := newTestStores(schema)
	require.NoError(t, err)
	holder, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer holder.Rollback(ctx)
	_, err = store.ClaimTx(ctx, holder, claimOf("m", "fp"))
	require.NoError(t, err)

	var claimed atomic.Int64
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for w, order := range [][]string{{"z", "m", "a"}, {"a", "m", "z"}} {
		wg.Go(func() {
			errs[w] = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				res, err := store.ClaimBatchTx(ctx, tx, []string{"SET LOCAL lock_timeout = 60000"}, batchOf(order...), each)
				for _, r := range res {
					if r.Claimed {
						claimed.Add(1)
					}
				}
				return err
			})
		})
	}
	pgtest.WaitFor(t, 30*time.Second, "both batches wait", func() bool {
		return pgtest.Count(t, pool, `SELECT count(*) FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND query LIKE '%INSERT INTO%inbox%' AND application_name = $1`, "idem-test:"+schema) >= 2
	})
	require.NoError(t, holder.Rollback(ctx))
	wg.Wait()
	for _, err := range errs {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) {
			require.NotEqual(t, pgerrcode.DeadlockDetected, pgErr.Code, "deadlock")
		}
		require.NoError(t, err)
	}
	require.EqualValues(t, 3, claimed.Load(), "each key claimed once")
	require.Equal(t, 3, pgtest.Count(t, pool, `SELECT count(*) FROM inbox`))
}
