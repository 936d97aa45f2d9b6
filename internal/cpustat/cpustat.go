// Package cpustat measures CPU time and heap allocations for idem's benchmarks:
// this process's, and that of the Postgres backends of a pool, read from /proc when
// Postgres runs on the same host. It is the one measuring helper of `idem bench`
// and the package benchmarks, so that each reports the same figures the same way.
//
// A backend is found by its application_name (pg_stat_activity; on a Citus
// coordinator, citus_stat_activity adds the workers' backends that serve it), and
// its time on CPU read from /proc/<pid>/schedstat. Where there is no /proc (not Linux) or
// Postgres runs elsewhere, the backends' share is reported as unknown, never as 0.
// It imports nothing of idem.
package cpustat

import (
	"context"
	"os"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// Querier runs the query that lists a pool's backends (a *pgxpool.Pool or a
// *pgx.Conn).
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// Sample is the CPU time and heap allocations used so far by this process and
// the CPU time of each backend that could be read.
type Sample struct {
	Self     time.Duration         // this process, user and system
	Backends map[int]time.Duration // by pid
	// Mallocs and AllocBytes are this process's heap allocations so far
	// (runtime.MemStats' Mallocs and TotalAlloc).
	Mallocs, AllocBytes uint64
	// GC and Busy are the runtime's estimates of the CPU time its garbage
	// collector, and all its non-idle work, used so far (runtime/metrics'
	// /cpu/classes). Only their ratio is kept (Delta.GCShare).
	GC, Busy time.Duration
}

// Take samples this process and the backends whose application_name is appName
// ("" for none). A failed lookup of the backends leaves Backends empty.
func Take(ctx context.Context, q Querier, appName string) Sample {
	return take(ctx, q, appName, backendsSQL)
}

// TakeCitus is Take on a Citus coordinator: it samples the backends whose
// application_name is appName and the backends on the workers that serve them
// (citus_stat_activity, by their global pid). The workers' time is read from
// /proc too, so it is seen only when they run on this host.
func TakeCitus(ctx context.Context, q Querier, appName string) Sample {
	return take(ctx, q, appName, citusBackendsSQL)
}

const (
	backendsSQL      = `SELECT pid FROM pg_stat_activity WHERE application_name = $1`
	citusBackendsSQL = `SELECT pid FROM citus_stat_activity WHERE global_pid IN (
		SELECT global_pid FROM citus_stat_activity WHERE application_name = $1)`
)

func take(ctx context.Context, q Querier, appName, pidsSQL string) Sample {
	s := Sample{Self: Process(), Backends: map[int]time.Duration{}}
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	s.Mallocs, s.AllocBytes = ms.Mallocs, ms.TotalAlloc
	s.GC, s.Busy = runtimeCPU()
	if q == nil || appName == "" {
		return s
	}
	for _, pid := range pids(ctx, q, pidsSQL, appName) {
		if t, ok := Schedstat("/proc/" + strconv.Itoa(pid) + "/schedstat"); ok {
			s.Backends[pid] = t
		}
	}
	return s
}

// Delta is what was used between two samples.
type Delta struct {
	Self                time.Duration
	Mallocs, AllocBytes uint64
	// GCShare is the garbage collector's share of this process's CPU time, by
	// the runtime's estimates (0 when it ran nothing).
	GCShare float64
	// Backends is the CPU time of the backends, and BackendsSeen false when none
	// could be read in the later sample (Postgres on another host, or no /proc).
	Backends     time.Duration
	BackendsSeen bool
}

// Since is what was used from the earlier sample b to a. A backend present in both
// counts its difference; one that is only in a started in between, and counts all
// of its time (warm a pool up before the first sample to leave its start-up out). A
// backend that ended in between is not counted.
func (a Sample) Since(b Sample) Delta {
	d := Delta{Self: a.Self - b.Self, Mallocs: a.Mallocs - b.Mallocs, AllocBytes: a.AllocBytes - b.AllocBytes}
	if busy := a.Busy - b.Busy; busy > 0 {
		d.GCShare = min(float64(a.GC-b.GC)/float64(busy), 1)
	}
	for pid, t := range a.Backends {
		d.Backends += t - b.Backends[pid]
		d.BackendsSeen = true
	}
	return d
}

// Backends lists the pids of the backends whose application_name is appName.
func Backends(ctx context.Context, q Querier, appName string) []int {
	return pids(ctx, q, backendsSQL, appName)
}

func pids(ctx context.Context, q Querier, query, appName string) []int {
	rows, err := q.Query(ctx, query, appName)
	if err != nil {
		return nil
	}
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		return nil
	}
	return pids
}

// Process is the CPU time this process has used, user and system, its ended
// threads included (getrusage).
func Process() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// Schedstat reads the time on CPU from a schedstat file (/proc/<pid>/schedstat, or
// a thread's under /proc/<pid>/task): its first field, in ns.
func Schedstat(path string) (time.Duration, bool) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	f := strings.Fields(string(raw))
	if len(f) == 0 {
		return 0, false
	}
	ns, err := strconv.ParseInt(f[0], 10, 64)
	return time.Duration(ns), err == nil
}

// PerOp is d divided over n operations, in microseconds.
func PerOp(d time.Duration, n int) float64 {
	if n <= 0 {
		return 0
	}
	return float64(d) / float64(time.Microsecond) / float64(n)
}
