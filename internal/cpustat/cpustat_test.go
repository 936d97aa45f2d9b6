package cpustat_test

import (
	"context"
	"crypto/sha256"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/cpustat"
	"github.com/idemkit/idem/internal/pgtest"
)

// TestSampleCountsWork: work done between two samples shows in their delta, on
// both sides: this process's CPU time and allocations, and the CPU time of a
// backend named by its application_name.
func TestSampleCountsWork(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 2})
	ctx := context.Background()
	app := "idem-test:" + schema // pgtest's application_name for the pool
	require.NoError(t, pool.Ping(ctx))
	before := cpustat.Take(ctx, pool, app)

	// A fixed amount of work (about 50 ms of CPU here), not a fixed time: on a
	// busy machine a 50 ms loop may get a few ms of CPU.
	sum := sha256.Sum256(nil)
	var keep [][]byte
	for i := range 200_000 {
		sum = sha256.Sum256(sum[:])
		if i%10 == 0 {
			keep = append(keep, make([]byte, 64))
		}
	}
	runtime.KeepAlive(keep)
	_, err := pool.Exec(ctx, `SELECT count(*) FROM generate_series(1, 2000000)`)
	require.NoError(t, err)

	d := cpustat.Take(ctx, pool, app).Since(before)
	require.Greater(t, d.Self, 10*time.Millisecond)
	require.GreaterOrEqual(t, d.Mallocs, uint64(len(keep)))
	require.GreaterOrEqual(t, d.AllocBytes, uint64(64*len(keep)))
	if _, err := os.Stat("/proc/self/schedstat"); err != nil {
		t.Fatalf("this test needs /proc (Linux): %v", err)
	}
	require.True(t, d.BackendsSeen, "the pool's backend is on this host")
	require.Greater(t, d.Backends, 10*time.Millisecond, "the backend counted two million rows")
}

// TestSinceCountsNewBackends: a backend that started between two samples counts
// all of its time; one that ended is not counted.
func TestSinceCountsNewBackends(t *testing.T) {
	t.Parallel()
	a := cpustat.Sample{Backends: map[int]time.Duration{1: 5, 2: 7}}
	b := cpustat.Sample{Backends: map[int]time.Duration{1: 8, 3: 4}}
	d := b.Since(a)
	require.Equal(t, time.Duration(3+4), d.Backends)
	require.True(t, d.BackendsSeen)
	require.False(t, cpustat.Sample{}.Since(a).BackendsSeen)
	require.InDelta(t, 2.5, cpustat.PerOp(5*time.Microsecond, 2), 1e-9)
	require.Zero(t, cpustat.PerOp(time.Second, 0))
}

// TestGCShare: a window that collects garbage has a GC share between 0 and 1.
func TestGCShare(t *testing.T) {
	before := cpustat.Take(context.Background(), nil, "")
	var keep []byte
	for range 2000 {
		keep = make([]byte, 64<<10)
	}
	runtime.GC()
	runtime.KeepAlive(keep)
	d := cpustat.Take(context.Background(), nil, "").Since(before)
	require.Greater(t, d.GCShare, 0.0)
	require.LessOrEqual(t, d.GCShare, 1.0)
}

// TestTakeCitusCountsTheWorkers: on a Citus coordinator, TakeCitus counts the
// time of the backends on the workers that serve the pool's sessions, which Take,
// reading the coordinator's backends only, leaves out.
func TestTakeCitusCountsTheWorkers(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.Citus(t, pgtest.Options{MaxConns: 2})
	ctx := context.Background()
	app := "idem-test:" + schema // pgtest's application_name for the pool
	release := pgtest.CitusDDL(t)
	_, err := pool.Exec(ctx, `CREATE TABLE rows (tenant text NOT NULL, n int NOT NULL)`)
	if err == nil {
		_, err = pool.Exec(ctx, `SELECT create_distributed_table('rows', 'tenant')`)
	}
	release()
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO rows SELECT 't' || (i % 32), i FROM generate_series(1, 400000) i`)
	require.NoError(t, err)

	before, beforeCitus := cpustat.Take(ctx, pool, app), cpustat.TakeCitus(ctx, pool, app)
	// The work runs on the workers, in a transaction that keeps their connections
	// open until both samples are taken.
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	var sum int64
	require.NoError(t, tx.QueryRow(ctx, `SELECT sum(length(repeat(tenant, 200))) FROM rows`).Scan(&sum))
	require.Positive(t, sum)
	coordinator := cpustat.Take(ctx, pool, app).Since(before)
	all := cpustat.TakeCitus(ctx, pool, app).Since(beforeCitus)
	require.True(t, all.BackendsSeen, "the Citus cluster runs on this host")
	require.Greater(t, len(cpustat.TakeCitus(ctx, pool, app).Backends), len(cpustat.Take(ctx, pool, app).Backends),
		"TakeCitus lists the workers' backends too")
	require.Greater(t, all.Backends-coordinator.Backends, 20*time.Millisecond,
		"the workers' backends repeated 400,000 strings 200 times, and TakeCitus counted it")
}
