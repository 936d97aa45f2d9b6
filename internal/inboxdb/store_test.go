package inboxdb_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/pgtest"
)

func setup(t *testing.T) (*inboxdb.Store, *pgtestBundle) {
	t.Helper()
	t.Parallel()
	pool, schema := pgtest.Setup(t)
	store, err := inboxdb.NewStore(schema)
	require.NoError(t, err)
	return store, &pgtestBundle{pool: pool, schema: schema}
}

type pgtestBundle struct {
	pool interface {
		Begin(context.Context) (pgx.Tx, error)
		QueryRow(context.Context, string, ...any) pgx.Row
	}
	schema string
}

func claimOf(key string, fp string) inboxdb.Claim {
	return inboxdb.Claim{ID: inboxdb.ID{Consumer: "c", Key: key}, Fingerprint: []byte(fp)}
}

func TestClaimTx(t *testing.T) {
	ctx := context.Background()
	store, b := setup(t)

	var res inboxdb.ClaimResult
	require.NoError(t, pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) (err error) {
		res, err = store.ClaimTx(ctx, tx, claimOf("k1", "fp"))
		return err
	}))
	require.True(t, res.Claimed)

	require.NoError(t, pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) (err error) {
		res, err = store.ClaimTx(ctx, tx, claimOf("k1", "fp"))
		return err
	}))
	require.False(t, res.Claimed)
	require.False(t, res.Mismatch)
	require.Equal(t, inboxdb.StateCompleted, res.Existing.State)
	require.WithinDuration(t, res.Existing.Now.Add(inboxdb.DefaultRetention), res.Existing.ExpiresAt, time.Minute)

	require.NoError(t, pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) (err error) {
		res, err = store.ClaimTx(ctx, tx, claimOf("k1", "other"))
		return err
	}))
	require.True(t, res.Mismatch)
}

func TestClaimRolledBackLeavesNothing(t *testing.T) {
	ctx := context.Background()
	store, b := setup(t)
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	res, err := store.ClaimTx(ctx, tx, claimOf("k", "fp"))
	require.NoError(t, err)
	require.True(t, res.Claimed)
	require.NoError(t, tx.Rollback(ctx))
	require.Equal(t, 0, pgtest.Count(t, b.pool, `SELECT count(*) FROM `+b.schema+`.inbox`))
}

// Two transactions claim one key at once: the second waits for the first and then
// sees its committed row, or owns the key if the first rolls back.
func TestClaimConcurrentWaitsForWinner(t *testing.T) {
	ctx := context.Background()
	store, b := setup(t)
	for _, commit := range []bool{true, false} {
		key := "k-" + map[bool]string{true: "commit", false: "rollback"}[commit]
		tx1, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		res, err := store.ClaimTx(ctx, tx1, claimOf(key, "fp"))
		require.NoError(t, err)
		require.True(t, res.Claimed)

		var wg sync.WaitGroup
		var res2 inboxdb.ClaimResult
		var err2 error
		wg.Add(1)
		go func() {
			defer wg.Done()
			err2 = pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) (err error) {
				res2, err = store.ClaimTx(ctx, tx, claimOf(key, "fp"))
				return err
			})
		}()
		// The second claim waits for the first transaction's row lock.
		pgtest.WaitFor(t, 30*time.Second, "the second claim waits", func() bool {
			return pgtest.Count(t, b.pool, `SELECT count(*) FROM pg_stat_activity
				WHERE wait_event_type = 'Lock' AND application_name = $1`, "idem-test:"+b.schema) > 0
		})
		if commit {
			require.NoError(t, tx1.Commit(ctx))
		} else {
			require.NoError(t, tx1.Rollback(ctx))
		}
		wg.Wait()
		require.NoError(t, err2)
		require.Equal(t, !commit, res2.Claimed, "commit=%v", commit)
	}
}

func TestFailAndLease(t *testing.T) {
	ctx := context.Background()
	store, b := setup(t)
	pool := b.pool.(interface {
		inboxdb.DBTX
	})
	res, err := store.FailTx(ctx, pool, claimOf("f", "fp"), "bad", "it broke")
	require.NoError(t, err)
	require.True(t, res.Claimed)
	rec, err := store.Get(ctx, pool, inboxdb.ID{Consumer: "c", Key: "f"})
	require.NoError(t, err)
	require.Equal(t, inboxdb.StateFailed, rec.State)
	require.Equal(t, "bad", rec.ErrorCode)

	// Lease: the first holder gets fence 1; a second sees a fresh lease.
	res, err = store.Lease(ctx, pool, claimOf("l", "fp"), 200*time.Millisecond)
	require.NoError(t, err)
	require.True(t, res.Claimed)
	require.EqualValues(t, 1, res.Fence)
	res2, err := store.Lease(ctx, pool, claimOf("l", "fp"), time.Minute)
	require.NoError(t, err)
	require.False(t, res2.Claimed)
	require.Equal(t, inboxdb.StateProcessing, res2.Existing.State)

	// After the lease runs out, a takeover bumps the fence and the old holder loses.
	time.Sleep(300 * time.Millisecond)
	res3, err := store.Lease(ctx, pool, claimOf("l", "fp"), time.Minute)
	require.NoError(t, err)
	require.True(t, res3.Claimed)
	require.EqualValues(t, 2, res3.Fence)
	id := inboxdb.ID{Consumer: "c", Key: "l"}
	require.ErrorIs(t, store.CompleteLeaseTx(ctx, pool, id, 1, 0), inboxdb.ErrLeaseLost)
	require.NoError(t, store.CompleteLeaseTx(ctx, pool, id, 2, 0))
}

func TestMissingSchemaIsTypedError(t *testing.T) {
	ctx := context.Background()
	t.Parallel()
	pool, schema := pgtest.Setup(t, pgtest.Options{NoMigrate: true})
	store, err := inboxdb.NewStore(schema)
	require.NoError(t, err)
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := store.ClaimTx(ctx, tx, claimOf("k", "fp"))
		return err
	})
	require.ErrorIs(t, err, pgschema.ErrMissing)
	require.Contains(t, err.Error(), "idem migrate up")
}

func TestInvalidSchema(t *testing.T) {
	t.Parallel()
	for _, s := range []string{"Bad", "a;drop", "1x", strings.Repeat("a", 64)} {
		_, err := inboxdb.NewStore(s)
		require.ErrorIs(t, err, pgschema.ErrInvalid, s)
	}
}
