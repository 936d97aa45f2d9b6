package inboxdb_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/inboxdb"
)

// TestFailStoresAnyBytes: the store records a permanent failure whatever bytes its
// code and error hold (a handler may quote a binary body, a panic value may be
// anything), in FailTx and in FailLease. (Before, Postgres refused the row with
// 22021 and the failure was never recorded.)
func TestFailStoresAnyBytes(t *testing.T) {
	ctx := context.Background()
	store, b := setup(t)
	pool := b.pool.(inboxdb.DBTX)
	const junk = "upstream said \x00\xff\xfe"
	res, err := store.FailTx(ctx, pool, claimOf("f", "fp"), "code\x00", junk)
	require.NoError(t, err)
	require.True(t, res.Claimed)
	rec, err := store.Get(ctx, pool, inboxdb.ID{Consumer: "c", Key: "f"})
	require.NoError(t, err)
	require.Equal(t, `code\x00`, rec.ErrorCode)
	require.Equal(t, `upstream said \x00\xff\xfe`, rec.Error)

	lease, err := store.Lease(ctx, pool, claimOf("l", "fp"), time.Minute)
	require.NoError(t, err)
	id := inboxdb.ID{Consumer: "c", Key: "l"}
	require.NoError(t, store.FailLease(ctx, pool, id, lease.Fence, time.Hour, "permanent", junk))
	rec, err = store.Get(ctx, pool, id)
	require.NoError(t, err)
	require.Equal(t, inboxdb.StateFailed, rec.State)
	require.Equal(t, `upstream said \x00\xff\xfe`, rec.Error)
}
