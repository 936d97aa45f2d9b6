package inboxdb_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/inboxdb"
)

// TestTenantScope: the tenant is part of the key. The same key from two tenants is
// two operations, and Get with another tenant (or none) does not find a tenant's
// record.
func TestTenantScope(t *testing.T) {
	store, b := setup(t)
	ctx := context.Background()
	pool := b.pool.(*pgxpool.Pool)
	claim := func(tenant, fp string) inboxdb.ClaimResult {
		var res inboxdb.ClaimResult
		require.NoError(t, pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
			var err error
			res, err = store.ClaimTx(ctx, tx, inboxdb.Claim{
				ID: inboxdb.ID{Consumer: "orders", Tenant: tenant, Key: "order-1"}, Fingerprint: []byte(fp),
			})
			return err
		}))
		return res
	}
	require.True(t, claim("acme", "a").Claimed)
	require.True(t, claim("globex", "g").Claimed, "same key, other tenant: its own operation, even with another payload")
	again := claim("acme", "a")
	require.False(t, again.Claimed)
	require.False(t, again.Mismatch)

	rec, err := store.Get(ctx, pool, inboxdb.ID{Consumer: "orders", Tenant: "acme", Key: "order-1"})
	require.NoError(t, err)
	require.Equal(t, "acme", rec.Tenant)
	require.Equal(t, []byte("a"), rec.Fingerprint)

	_, err = store.Get(ctx, pool, inboxdb.ID{Consumer: "orders", Tenant: "initech", Key: "order-1"})
	require.ErrorIs(t, err, inboxdb.ErrNotFound)
	_, err = store.Get(ctx, pool, inboxdb.ID{Consumer: "orders", Key: "order-1"})
	require.ErrorIs(t, err, inboxdb.ErrNotFound, "no tenant is a scope of its own, not a wildcard")
}
