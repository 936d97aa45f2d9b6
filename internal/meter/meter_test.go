package meter_test

import (
	"context"
	"crypto/sha256"
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/meter"
	"github.com/idemkit/idem/internal/pgtest"
)

var sink [][]byte

// TestMeasures: work done between two samples shows in every figure: this
// process's CPU and allocations, and the CPU of the backend that ran the queries.
func TestMeasures(t *testing.T) {
	pool, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 1, NoMigrate: true})
	ctx := context.Background()
	pids, err := meter.BackendPIDs(ctx, pool, "idem-test:"+schema)
	require.NoError(t, err)
	require.Len(t, pids, 1, "the pool's one backend")

	before := meter.Take(pids)
	sum := sha256.Sum256(nil)
	for range 20000 {
		sum = sha256.Sum256(sum[:])
		sink = append(sink, make([]byte, 64))
	}
	for range 50 {
		_, err := pool.Exec(ctx, `SELECT count(*) FROM generate_series(1, 20000)`)
		require.NoError(t, err)
	}
	d := meter.Take(pids).Since(before)
	sink = nil

	require.Positive(t, d.Process, "this process's CPU")
	require.GreaterOrEqual(t, d.Allocs, uint64(20000), "at least the slices made")
	require.GreaterOrEqual(t, d.Bytes, uint64(20000*64))
	if runtime.GOOS != "linux" {
		require.False(t, d.PostgresSeen, "schedstat is Linux's")
		return
	}
	require.True(t, d.PostgresSeen, "the backend's schedstat was read")
	require.Positive(t, d.Postgres, "the backend ran 50 queries")

	per := d.Add(d).Per(2)
	require.InDelta(t, float64(d.Allocs), per.Allocs, 0.5)
	require.InDelta(t, float64(d.Process.Microseconds()), per.ProcessMicros, 1)
}
