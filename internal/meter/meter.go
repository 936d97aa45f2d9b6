// Package meter reads what a benchmark reports per unit of work (a request, a
// delivery): the CPU time of this process and of the Postgres backends that served
// it, and the heap allocations this process made. Take a Sample before and after a
// stretch of work; Since gives the difference, Per divides it by the units done.
//
// The process's CPU time is getrusage's (user + system, all threads, exact to the
// microsecond on Linux). A backend's comes from /proc/<pid>/schedstat, so it is
// read only on Linux with Postgres on the same host; elsewhere the Postgres figures
// are absent (Delta.PostgresSeen false), never zero. Allocations come from
// runtime/metrics, which stops nothing.
//
// It is a leaf: the HTTP benchmark and `idem bench` both use it, and it imports
// nothing of idem.
package meter

import (
	"context"
	"runtime/metrics"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/procfs"
)

// Sample is one reading.
type Sample struct {
	// Process is this process's CPU time so far, user and system.
	Process time.Duration
	// Backends is the CPU time so far of each backend that could be read, by pid.
	Backends map[int]time.Duration
	// Allocs and Bytes are the heap allocations so far: objects and bytes.
	Allocs, Bytes uint64
}

// Delta is the cost of a stretch of work, between two Samples.
type Delta struct {
	Process  time.Duration
	Postgres time.Duration
	// PostgresSeen: at least one backend was read in both samples.
	PostgresSeen bool
	Allocs       uint64
	Bytes        uint64
}

// Querier runs a query; *pgxpool.Pool, *pgx.Conn and pgx.Tx do.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// BackendPIDs lists the pids of the backends whose application_name is app (a
// pool's, set in its connection string), as pg_stat_activity shows them.
func BackendPIDs(ctx context.Context, db Querier, app string) ([]int, error) {
	rows, err := db.Query(ctx, `SELECT pid FROM pg_stat_activity WHERE application_name = $1`, app)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[int])
}

var allocMetrics = []metrics.Sample{{Name: "/gc/heap/allocs:objects"}, {Name: "/gc/heap/allocs:bytes"}}

// Take reads the process and the backends in pids (those that cannot be read are
// left out).
func Take(pids []int) Sample {
	s := Sample{Process: processCPU(), Backends: make(map[int]time.Duration, len(pids))}
	if fs, err := procfs.NewDefaultFS(); err == nil {
		for _, pid := range pids {
			if p, err := fs.Proc(pid); err == nil {
				if st, err := p.Schedstat(); err == nil {
					s.Backends[pid] = time.Duration(st.RunningNanoseconds)
				}
			}
		}
	}
	ms := make([]metrics.Sample, len(allocMetrics))
	copy(ms, allocMetrics)
	metrics.Read(ms)
	if ms[0].Value.Kind() == metrics.KindUint64 {
		s.Allocs = ms[0].Value.Uint64()
	}
	if ms[1].Value.Kind() == metrics.KindUint64 {
		s.Bytes = ms[1].Value.Uint64()
	}
	return s
}

// processCPU is getrusage's user + system time of this process.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// Since is the cost from prev to s. Only backends present in both count.
func (s Sample) Since(prev Sample) Delta {
	d := Delta{Process: s.Process - prev.Process, Allocs: s.Allocs - prev.Allocs, Bytes: s.Bytes - prev.Bytes}
	for pid, t := range s.Backends {
		if t0, ok := prev.Backends[pid]; ok {
			d.Postgres += t - t0
			d.PostgresSeen = true
		}
	}
	return d
}

// Add sums two deltas (rounds of the same side of a benchmark). Postgres is seen
// only if it was in both.
func (d Delta) Add(o Delta) Delta {
	return Delta{
		Process: d.Process + o.Process, Postgres: d.Postgres + o.Postgres,
		PostgresSeen: d.PostgresSeen && o.PostgresSeen,
		Allocs:       d.Allocs + o.Allocs, Bytes: d.Bytes + o.Bytes,
	}
}

// PerUnit is a Delta divided by the units of work it covers.
type PerUnit struct {
	// ProcessMicros and PostgresMicros are CPU µs per unit; PostgresMicros is
	// meaningful only if PostgresSeen.
	ProcessMicros, PostgresMicros float64
	PostgresSeen                  bool
	// Allocs and Bytes are heap allocations per unit.
	Allocs, Bytes float64
}

// Per divides d by n units of work.
func (d Delta) Per(n int) PerUnit {
	f := float64(max(n, 1))
	return PerUnit{
		ProcessMicros:  float64(d.Process.Nanoseconds()) / 1e3 / f,
		PostgresMicros: float64(d.Postgres.Nanoseconds()) / 1e3 / f,
		PostgresSeen:   d.PostgresSeen,
		Allocs:         float64(d.Allocs) / f,
		Bytes:          float64(d.Bytes) / f,
	}
}
