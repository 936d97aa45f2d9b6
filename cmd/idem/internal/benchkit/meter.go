package benchkit

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime/pprof"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/cpustat"
)

// CPU is what a setup's run cost per delivery (per effect for the Dispatcher),
// measured over the timed part of the run only.
type CPU struct {
	// GoMicros is this process's CPU time per delivery, in µs: idem, Watermill,
	// pgx and the benchmark's own producers (and kfake in the kafka setup).
	GoMicros float64 `json:"go_cpu_us"`
	// GCMicros is the part of GoMicros the garbage collector spent, by the
	// runtime's estimate of its share.
	GCMicros float64 `json:"gc_cpu_us"`
	// PgMicros is the CPU time per delivery of the run's own Postgres backends
	// (its pool's, found by application_name); nil when they cannot be read
	// (Postgres on another host, or no /proc).
	PgMicros *float64 `json:"pg_cpu_us,omitempty"`
	// Allocs and AllocBytes are this process's heap allocations per delivery.
	Allocs     float64 `json:"allocs"`
	AllocBytes float64 `json:"alloc_bytes"`
}

// newAppName is the application_name of one run's pool, by which its backends
// are found: short, since Postgres keeps 63 bytes of it.
func newAppName() string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return "idem-bench-" + hex.EncodeToString(b)
}

// meter measures the timed part of one run: this process's CPU time and
// allocations, and the CPU time of the run's Postgres backends; with
// Options.ProfileDir, also a CPU profile and allocation profiles of that window.
type meter struct {
	pool   *pgxpool.Pool
	app    string
	before cpustat.Sample
	cpu    *os.File
	prefix string
}

// startMeter warms the pool up (so that the backends' start-up is not counted)
// and takes the first sample.
func startMeter(ctx context.Context, o Options, setup Setup, pool *pgxpool.Pool) (*meter, error) {
	m := &meter{pool: pool, app: pool.Config().ConnConfig.RuntimeParams["application_name"]}
	if err := warm(ctx, pool); err != nil {
		return nil, err
	}
	if o.ProfileDir != "" {
		m.prefix = filepath.Join(o.ProfileDir, string(setup))
		if err := writeAllocs(m.prefix + ".allocs-start.pprof"); err != nil {
			return nil, err
		}
		f, err := os.Create(m.prefix + ".cpu.pprof")
		if err != nil {
			return nil, err
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			_ = f.Close()
			return nil, fmt.Errorf("cpu profile: %w", err)
		}
		m.cpu = f
	}
	m.before = cpustat.Take(ctx, pool, m.app)
	return m, nil
}

// stop takes the second sample and returns the cost per delivery of n deliveries.
func (m *meter) stop(ctx context.Context, n int) (CPU, error) {
	d := cpustat.Take(ctx, m.pool, m.app).Since(m.before)
	var errs []error
	if m.cpu != nil {
		pprof.StopCPUProfile()
		errs = append(errs, m.cpu.Close(), writeAllocs(m.prefix+".allocs.pprof"))
		m.cpu = nil
	}
	c := CPU{GoMicros: cpustat.PerOp(d.Self, n)}
	c.GCMicros = c.GoMicros * d.GCShare
	if n > 0 {
		c.Allocs, c.AllocBytes = float64(d.Mallocs)/float64(n), float64(d.AllocBytes)/float64(n)
	}
	if d.BackendsSeen {
		pg := cpustat.PerOp(d.Backends, n)
		c.PgMicros = &pg
	}
	return c, errors.Join(errs...)
}

// close stops a profile that stop did not (a run that failed).
func (m *meter) close() {
	if m != nil && m.cpu != nil {
		pprof.StopCPUProfile()
		_ = m.cpu.Close()
		m.cpu = nil
	}
}

// writeAllocs writes the allocation profile so far (pprof's "allocs": every
// sampled allocation since the start). The difference of two is a window's:
// go tool pprof -sample_index=alloc_space -diff_base X.allocs-start.pprof X.allocs.pprof
func writeAllocs(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := pprof.Lookup("allocs").WriteTo(f, 0); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}

// warm opens every connection of the pool, and gives them back.
func warm(ctx context.Context, pool *pgxpool.Pool) error {
	conns := make([]*pgxpool.Conn, 0, pool.Config().MaxConns)
	defer func() {
		for _, c := range conns {
			c.Release()
		}
	}()
	for range pool.Config().MaxConns {
		c, err := pool.Acquire(ctx)
		if err != nil {
			return err
		}
		conns = append(conns, c)
	}
	return nil
}
