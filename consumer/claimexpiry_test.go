package consumer

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/pgtest"
)

// expire makes every settled row of the test schema past its expiry.
func expire(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	_, err := pool.Exec(context.Background(), `UPDATE inbox SET expires_at = now() - interval '1 second' WHERE state <> 'processing'`)
	require.NoError(t, err)
}

// Every claim of the message consumers forgets a settled row past its expires_at,
// before the janitor deletes it: the key is claimed as new (Expired), whatever the
// old row's state and fingerprint. A row that has not expired answers the claim.
func TestClaimsForgetExpiredRows(t *testing.T) {
	store, pool := setupStores(t)
	ctx := context.Background()
	claims := map[string]func(c inboxdb.Claim) (inboxdb.ClaimResult, error){
		"ClaimTx": func(c inboxdb.Claim) (res inboxdb.ClaimResult, err error) {
			err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) (err error) { res, err = store.ClaimTx(ctx, tx, c); return })
			return
		},
		"ClaimAfterTx": func(c inboxdb.Claim) (res inboxdb.ClaimResult, err error) {
			err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) (err error) {
				res, err = store.ClaimAfterTx(ctx, tx, []string{"SAVEPOINT s"}, c)
				return
			})
			return
		},
		"FailTx": func(c inboxdb.Claim) (res inboxdb.ClaimResult, err error) {
			err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) (err error) { res, err = store.FailTx(ctx, tx, c, "code", "text"); return })
			return
		},
		"Lease": func(c inboxdb.Claim) (inboxdb.ClaimResult, error) { return store.Lease(ctx, pool, c, time.Minute) },
		"ClaimBatchTx": func(c inboxdb.Claim) (res inboxdb.ClaimResult, err error) {
			err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				results, err := store.ClaimBatchTx(ctx, tx, nil, []batchClaim{{Claim: c}, {Claim: claimOf(c.Key+"-other", "fp")}}, false)
				if err == nil {
					res = results[0]
				}
				return err
			})
			return
		},
		// The form for Citus: one single-row claim a key.
		"ClaimBatchTx, each": func(c inboxdb.Claim) (res inboxdb.ClaimResult, err error) {
			err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				results, err := store.ClaimBatchTx(ctx, tx, nil, []batchClaim{{Claim: c}, {Claim: claimOf(c.Key+"-other", "fp")}}, true)
				if err == nil {
					res = results[0]
				}
				return err
			})
			return
		},
		// A batch of two tenants' keys: the statements' forms for several tenants.
		"ClaimBatchTx, mixed tenants": func(c inboxdb.Claim) (res inboxdb.ClaimResult, err error) {
			other := claimOf(c.Key, "fp")
			other.Tenant = "t2"
			err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				results, err := store.ClaimBatchTx(ctx, tx, nil, []batchClaim{{Claim: c}, {Claim: other}}, false)
				if err == nil {
					res = results[0]
				}
				return err
			})
			return
		},
	}
	for name, claim := range claims {
		for _, state := range []string{"completed", "failed"} {
			key := name + "-" + state
			res, err := store.FailTx(ctx, pool, claimOf(key, "old"), "permanent", "declined")
			require.NoError(t, err)
			require.True(t, res.Claimed)
			if state == "completed" {
				_, err = pool.Exec(ctx, `UPDATE inbox SET state = 'completed', error_code = NULL, error = NULL WHERE key = $1`, key)
				require.NoError(t, err)
			}

			res, err = claim(claimOf(key, "new"))
			require.NoError(t, err)
			require.False(t, res.Claimed, "%s: a live row answers", key)
			require.True(t, res.Mismatch)
			require.False(t, res.Expired)

			expire(t, pool)
			res, err = claim(claimOf(key, "new"))
			require.NoError(t, err)
			require.True(t, res.Claimed, "%s: an expired row is forgotten", key)
			require.True(t, res.Expired)
			rec, err := store.Get(ctx, pool, claimOf(key, "").ID)
			require.NoError(t, err)
			require.Equal(t, []byte("new"), rec.Fingerprint)
			require.True(t, rec.ExpiresAt.After(rec.Now), "the new row is live")

			res, err = claim(claimOf(key, "new"))
			require.NoError(t, err)
			require.False(t, res.Claimed, "%s: and answers the next claim", key)
			require.False(t, res.Expired)
		}
	}

	// A processing row is a lease, never forgotten, whatever its expires_at says.
	res, err := store.Lease(ctx, pool, claimOf("leased", "fp"), time.Minute)
	require.NoError(t, err)
	require.True(t, res.Claimed)
	_, err = pool.Exec(ctx, `UPDATE inbox SET expires_at = now() - interval '1 second' WHERE key = 'leased'`)
	require.NoError(t, err)
	for name, claim := range claims {
		res, err := claim(claimOf("leased", "fp"))
		require.NoError(t, err, name)
		require.False(t, res.Claimed, name)
		require.False(t, res.Expired, name)
		require.Equal(t, inboxdb.StateProcessing, res.Existing.State, name)
	}
}

// Two transactions that meet the same expired row at once: one forgets it and
// claims the key, the other waits for it and is its duplicate.
func TestConcurrentClaimsOfAnExpiredKey(t *testing.T) {
	store, pool := setupStores(t)
	ctx := context.Background()
	for round := range 20 {
		key := claimOf("k"+string(rune('a'+round)), "fp")
		_, err := store.FailTx(ctx, pool, key, "permanent", "declined")
		require.NoError(t, err)
		expire(t, pool)
		var wg sync.WaitGroup
		results := make([]inboxdb.ClaimResult, 2)
		errs := make([]error, 2)
		for w := range 2 {
			wg.Go(func() {
				errs[w] = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '10s'`); err != nil {
						return err
					}
					if w == 0 {
						res, err := store.ClaimTx(ctx, tx, key)
						results[w] = res
						return err
					}
					rs, err := store.ClaimBatchTx(ctx, tx, nil, []batchClaim{{Claim: key}}, false)
					if err == nil {
						results[w] = rs[0]
					}
					return err
				})
			})
		}
		wg.Wait()
		require.NoError(t, errs[0])
		require.NoError(t, errs[1])
		require.NotEqual(t, results[0].Claimed, results[1].Claimed, "exactly one claims the key")
		for _, r := range results {
			if !r.Claimed {
				require.Equal(t, inboxdb.StateCompleted, r.Existing.State)
				require.True(t, r.Existing.ExpiresAt.After(r.Existing.Now), "the loser meets the winner's live row")
			}
		}
		require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE key = $1`, key.Key))
	}
}
