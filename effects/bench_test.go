package effects_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/cpustat"
	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/pgtest"
)

// BenchmarkDispatcherThroughput: b.N effects already due, a no-op sender, batch
// size 100. The time covers claiming, sending and recording every effect done.
//
//	go test -run '^$' -bench Throughput -benchtime 50000x ./effects
func BenchmarkDispatcherThroughput(b *testing.B) {
	pool, schema := pgtest.Setup(b, pgtest.Options{MaxConns: 8})
	enqueueMany(b, pool, "noop", "k", b.N)
	_, err := pool.Exec(context.Background(), `ANALYZE effects`)
	require.NoError(b, err)
	var sent atomic.Int64
	noop := effects.SenderFunc(func(context.Context, effects.Delivery) error { sent.Add(1); return nil })
	cfg := effects.Config{Pool: pool, Schema: schema, Senders: map[string]effects.Sender{"noop": noop},
		BatchSize: 100, Concurrency: map[string]int{"noop": 100}}
	b.ResetTimer()
	begin := time.Now()
	start(b, cfg)
	for sent.Load() < int64(b.N) {
		time.Sleep(time.Millisecond)
	}
	for pgtest.Count(b, pool, `SELECT count(*) FROM effects WHERE state = 'done'`) < b.N {
		time.Sleep(5 * time.Millisecond)
	}
	elapsed := time.Since(begin)
	b.StopTimer()
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "effects/s")
}

// BenchmarkEnqueueToSendLatency: the time from the enqueuing transaction's COMMIT
// (taken just before the call) to the Send call, one effect at a time, woken by
// LISTEN/NOTIFY (polling is an hour apart).
//
//	go test -run '^$' -bench Latency -benchtime 2000x ./effects
func BenchmarkEnqueueToSendLatency(b *testing.B) {
	pool, schema := pgtest.Setup(b, pgtest.Options{MaxConns: 4})
	got := make(chan time.Time, 1)
	sender := effects.SenderFunc(func(context.Context, effects.Delivery) error { got <- time.Now(); return nil })
	cfg := effects.Config{Pool: pool, Schema: schema, Senders: map[string]effects.Sender{"lat": sender},
		PollInterval: time.Hour}
	start(b, cfg)
	time.Sleep(200 * time.Millisecond) // LISTEN is up
	ctx := context.Background()
	lat := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := range b.N {
		tx, err := pool.Begin(ctx)
		require.NoError(b, err)
		_, err = effects.Enqueue(effects.WithScope(ctx, effects.Scope{Schema: schema}), tx, effects.Effect{Kind: "lat", Key: fmt.Sprint(i)})
		require.NoError(b, err)
		t0 := time.Now()
		require.NoError(b, tx.Commit(ctx))
		select {
		case t1 := <-got:
			lat = append(lat, t1.Sub(t0))
		case <-time.After(10 * time.Second):
			b.Fatalf("effect %d not sent within 10s", i)
		}
	}
	b.StopTimer()
	slices.Sort(lat)
	pct := func(p float64) float64 { return float64(lat[int(p*float64(len(lat)-1))]) / float64(time.Millisecond) }
	b.ReportMetric(pct(0.50), "p50-ms")
	b.ReportMetric(pct(0.99), "p99-ms")
	b.ReportMetric(float64(lat[len(lat)-1])/float64(time.Millisecond), "max-ms")
}

// BenchmarkEnqueueToSendLatencySteady: the same latency as
// BenchmarkEnqueueToSendLatency, with effects arriving at a steady rate: a
// transaction of 10 every 2 ms at most (5,000 effects/s; less when the enqueuing
// transactions take longer, as reported), b.N effects in all, sent by a
// Dispatcher set up as for BenchmarkDispatcherBacklog (BENCH_BATCH,
// BENCH_CONCURRENCY).
//
//	go test -run '^$' -bench LatencySteady -benchtime 50000x ./effects
func BenchmarkEnqueueToSendLatencySteady(b *testing.B) {
	pool, schema := pgtest.Setup(b, pgtest.Options{MaxConns: 8})
	var mu sync.Mutex
	committed := make(map[string]time.Time, b.N)
	lat := make([]time.Duration, 0, b.N)
	all := make(chan struct{})
	sender := effects.SenderFunc(func(_ context.Context, d effects.Delivery) error {
		now := time.Now()
		mu.Lock()
		defer mu.Unlock()
		lat = append(lat, now.Sub(committed[d.Key]))
		if len(lat) == b.N {
			close(all)
		}
		return nil
	})
	cfg := effects.Config{Pool: pool, Schema: schema, Senders: map[string]effects.Sender{"lat": sender},
		BatchSize: benchBatch, Concurrency: map[string]int{"lat": benchConcurrency}, PollInterval: time.Hour}
	start(b, cfg)
	time.Sleep(200 * time.Millisecond) // LISTEN is up
	ctx := context.Background()
	tick := time.NewTicker(2 * time.Millisecond)
	defer tick.Stop()
	b.ResetTimer()
	for i := 0; i < b.N; i += 10 {
		<-tick.C
		tx, err := pool.Begin(ctx)
		require.NoError(b, err)
		var keys []string
		for j := i; j < min(i+10, b.N); j++ {
			key := fmt.Sprint(j)
			_, err = effects.Enqueue(effects.WithScope(ctx, effects.Scope{Schema: schema}), tx, effects.Effect{Kind: "lat", Key: key})
			require.NoError(b, err)
			keys = append(keys, key)
		}
		mu.Lock()
		t0 := time.Now()
		for _, k := range keys {
			committed[k] = t0
		}
		mu.Unlock()
		require.NoError(b, tx.Commit(ctx))
	}
	select {
	case <-all:
	case <-time.After(time.Minute):
		b.Fatal("effects not all sent within a minute")
	}
	b.StopTimer()
	mu.Lock()
	defer mu.Unlock()
	slices.Sort(lat)
	pct := func(p float64) float64 { return float64(lat[int(p*float64(len(lat)-1))]) / float64(time.Millisecond) }
	b.ReportMetric(pct(0.50), "p50-ms")
	b.ReportMetric(pct(0.99), "p99-ms")
	b.ReportMetric(float64(lat[len(lat)-1])/float64(time.Millisecond), "max-ms")
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "effects/s")
}

// BenchmarkDispatcherBacklog: a burst of b.N effects lands in a table that was
// empty, and one Dispatcher with a no-op sender drains it. The sub-benchmarks differ
// only in the table's statistics when the drain starts:
//
//   - fresh: never analyzed, and autovacuum is off for the table, so it stays that
//     way for the whole drain (the worst case, and a steady one);
//   - stale: analyzed when it held 100 effects, then the burst;
//   - midway: fresh, and analyzed when half the burst is sent, as autovacuum may
//     do (the prepared statements are planned again);
//   - analyzed: ANALYZE after the burst (what BenchmarkDispatcherThroughput does).
//
// The time covers claiming, sending and recording every effect done. Besides
// effects/s it reports the claims and outcome writes (count, and mean time of the
// round trip), and the CPU time per effect of this process and of the pool's
// Postgres backends, which the machine's other load moves less than it moves the
// rate. BENCH_BATCH and BENCH_CONCURRENCY set the Dispatcher's BatchSize and
// Concurrency (default 1000 and 2000: a kind then holds up to three claims' worth,
// so a claim need not wait for the outcome write of the one before).
//
//	go test -run '^$' -bench Backlog -benchtime 100000x ./effects
func BenchmarkDispatcherBacklog(b *testing.B) {
	for _, stats := range []string{"fresh", "stale", "midway", "analyzed", "snapshot"} {
		b.Run(stats, func(b *testing.B) { drainBacklog(b, stats) })
	}
}

var (
	benchBatch       = envInt("BENCH_BATCH", 1000)
	benchConcurrency = envInt("BENCH_CONCURRENCY", 2000)
)

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil {
		return v
	}
	return def
}

func drainBacklog(b *testing.B, stats string) {
	pool, schema := pgtest.Setup(b, pgtest.Options{MaxConns: 8})
	ctx := context.Background()
	exec := func(sql string, args ...any) {
		b.Helper()
		_, err := pool.Exec(ctx, sql, args...)
		require.NoError(b, err)
	}
	// As Enqueue from a consumer writes them: with a source, which the source index
	// holds.
	burst := func(from, n int) {
		exec(`INSERT INTO effects (kind, key, payload, fingerprint, source_consumer, source_tenant, source_key)
			SELECT 'noop', 'k' || g, '{"to":"a@example.com"}'::bytea, sha256(g::text::bytea), 'orders', '', 'm' || g
			FROM generate_series($1::int, $1::int + $2::int - 1) g`, from, n)
	}
	switch stats {
	case "snapshot":
		// Another session holds a snapshot from before the drain (a long report, a
		// pg_dump): no row version the drain leaves behind can be removed, nor its
		// index entries marked dead, until it ends.
		conn, err := pgx.Connect(ctx, pgtest.URL())
		require.NoError(b, err)
		b.Cleanup(func() { require.NoError(b, conn.Close(context.Background())) })
		tx, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
		require.NoError(b, err)
		_, err = tx.Exec(ctx, `SELECT 1 FROM pg_class LIMIT 1`)
		require.NoError(b, err)
		b.Cleanup(func() { _ = tx.Rollback(context.Background()) })
		exec(`ALTER TABLE effects SET (autovacuum_enabled = off)`)
		burst(0, b.N)
	case "fresh", "midway":
		exec(`ALTER TABLE effects SET (autovacuum_enabled = off)`)
		burst(0, b.N)
	case "stale":
		exec(`ALTER TABLE effects SET (autovacuum_enabled = off)`)
		burst(-100, 100)
		exec(`ANALYZE effects`)
		burst(0, b.N)
	case "analyzed":
		burst(0, b.N)
		exec(`ANALYZE effects`)
	}
	want := int64(b.N)
	if stats == "stale" {
		want += 100
	}
	// The sender says when half and all of the effects are sent, so that nothing
	// polls meanwhile.
	var sent atomic.Int64
	half, all := make(chan struct{}), make(chan struct{})
	noop := effects.SenderFunc(func(context.Context, effects.Delivery) error {
		n := sent.Add(1)
		if n == max(want/2, 1) {
			close(half)
		}
		if n == want {
			close(all)
		}
		return nil
	})
	tr := &stmtTracer{}
	cfg := effects.Config{Pool: tracedPool(b, schema, 8, tr), Schema: schema, Senders: map[string]effects.Sender{"noop": noop},
		BatchSize: benchBatch, Concurrency: map[string]int{"noop": benchConcurrency}}
	b.ResetTimer()
	begin := time.Now()
	cpu := startCPU(b, pool, schema)
	stop := start(b, cfg)
	if stats == "midway" {
		<-half
		exec(`ANALYZE effects`)
	}
	<-all
	for pgtest.Count(b, pool, `SELECT count(*) FROM effects WHERE state = 'pending'`) > 0 {
		time.Sleep(2 * time.Millisecond)
	}
	elapsed := time.Since(begin)
	b.StopTimer()
	cpu.report(b, int(want))
	stop()
	b.ReportMetric(float64(want)/elapsed.Seconds(), "effects/s")
	tr.report(b)
	var analyzed bool
	require.NoError(b, pool.QueryRow(ctx, `SELECT coalesce(last_analyze, last_autoanalyze) IS NOT NULL
		FROM pg_stat_user_tables WHERE relid = 'effects'::regclass`).Scan(&analyzed))
	if stats == "fresh" && analyzed {
		b.Fatal("the fresh table was analyzed during the drain")
	}
}

// stmtTracer sums the time of the Dispatcher's claim and outcome-write round trips,
// so a benchmark can say where its time went.
type stmtTracer struct {
	mu    sync.Mutex
	n     map[string]int
	total map[string]time.Duration
}

type stmtKey struct{}

type stmtStart struct {
	kind string
	at   time.Time
}

func (tr *stmtTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceBatchStartData) context.Context {
	kind := "other"
	for _, q := range data.Batch.QueuedQueries {
		switch {
		case strings.Contains(q.SQL, "SKIP LOCKED"):
			kind = "claim"
		case strings.Contains(q.SQL, "recorded_fence = d.fence"):
			kind = "record"
		}
	}
	return context.WithValue(ctx, stmtKey{}, stmtStart{kind, time.Now()})
}

func (tr *stmtTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (tr *stmtTracer) TraceBatchEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchEndData) {
	s, ok := ctx.Value(stmtKey{}).(stmtStart)
	if !ok {
		return
	}
	tr.mu.Lock()
	defer tr.mu.Unlock()
	if tr.n == nil {
		tr.n, tr.total = map[string]int{}, map[string]time.Duration{}
	}
	tr.n[s.kind]++
	tr.total[s.kind] += time.Since(s.at)
}

func (tr *stmtTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}

func (tr *stmtTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// report adds the count and mean time of claims and outcome writes to b's metrics.
func (tr *stmtTracer) report(b *testing.B) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	for _, kind := range []string{"claim", "record"} {
		if n := tr.n[kind]; n > 0 {
			b.ReportMetric(float64(n), kind+"s")
			b.ReportMetric(float64(tr.total[kind])/float64(n)/float64(time.Millisecond), kind+"-ms")
		}
	}
}

// tracedPool is a pool on schema whose round trips tr times.
func tracedPool(b *testing.B, schema string, maxConns int32, tr *stmtTracer) *pgxpool.Pool {
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	require.NoError(b, err)
	cfg.MaxConns = maxConns
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.ConnConfig.Tracer = tr
	cfg.ConnConfig.RuntimeParams["application_name"] = "idem-bench:" + schema
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(b, err)
	b.Cleanup(pool.Close)
	return pool
}

// cpuMeter measures the CPU time this process and the Postgres backends of one
// schema's benchmark pool spent (internal/cpustat), so a figure can be read apart
// from the machine's other load.
type cpuMeter struct {
	pool       *pgxpool.Pool
	schema     string
	before     cpustat.Sample
	idle, busy int64 // the machine's, in clock ticks
}

func startCPU(b *testing.B, pool *pgxpool.Pool, schema string) *cpuMeter {
	m := &cpuMeter{pool: pool, schema: schema, before: cpustat.Take(context.Background(), pool, "idem-bench:"+schema)}
	m.idle, m.busy = machineCPU(b)
	return m
}

// machineCPU is the time all of the machine's CPUs spent idle (or waiting for
// I/O) and busy since boot, from /proc/stat, in clock ticks.
func machineCPU(b *testing.B) (idle, busy int64) {
	raw, err := os.ReadFile("/proc/stat")
	require.NoError(b, err)
	line, _, _ := strings.Cut(string(raw), "\n")
	for i, f := range strings.Fields(line)[1:] {
		n, err := strconv.ParseInt(f, 10, 64)
		require.NoError(b, err)
		if i == 3 || i == 4 { // idle, iowait
			idle += n
		} else {
			busy += n
		}
	}
	return idle, busy
}

// report adds the Go process's and the backends' CPU time per effect (µs) to b's
// metrics, and how much of the machine's CPU stood idle meanwhile. The backends
// are read before the pool closes; a backend that started during the run counts
// from its start.
func (m *cpuMeter) report(b *testing.B, effects int) {
	d := cpustat.Take(context.Background(), m.pool, "idem-bench:"+m.schema).Since(m.before)
	idle, busy := machineCPU(b)
	idle, busy = idle-m.idle, busy-m.busy
	b.ReportMetric(100*float64(idle)/float64(idle+busy), "machine-idle-%")
	require.True(b, d.BackendsSeen, "the benchmark's Postgres backends could not be read")
	b.ReportMetric(cpustat.PerOp(d.Self, effects), "go-cpu-µs/effect")
	b.ReportMetric(cpustat.PerOp(d.Backends, effects), "pg-cpu-µs/effect")
	b.ReportMetric(float64(d.Mallocs)/float64(effects), "allocs/effect")
}

// BenchmarkEnqueueItems: one EnqueueItems call of 100 effects in a transaction
// that is rolled back, so every iteration writes into the same table. "fresh": no
// row exists, one statement. "half-stored": every other effect is stored already
// with the same payload, so the second statement reads their fingerprints and
// they come back as duplicates. The time covers the statements' round trips; the
// allocations are EnqueueItems' own and pgx's.
//
//	go test -run '^$' -bench EnqueueItems -benchmem ./effects
func BenchmarkEnqueueItems(b *testing.B) {
	for _, stored := range []bool{false, true} {
		name := "fresh"
		if stored {
			name = "half-stored"
		}
		b.Run(name, func(b *testing.B) {
			pool, schema := pgtest.Setup(b, pgtest.Options{MaxConns: 2})
			ctx := context.Background()
			scope := effectsdb.Scope{Schema: schema, Source: effectsdb.Source{Consumer: "bench", Tenant: "t", Key: "m"}}
			items := make([]effectsdb.Item, 100)
			for i := range items {
				items[i] = effectsdb.Item{Scope: scope, Effect: effectsdb.Effect{Kind: "mail", Key: fmt.Sprintf("receipt:%d", i), Payload: []byte(`{"to":"a@example.com"}`)}}
			}
			if stored {
				var half []effectsdb.Item
				for i := 0; i < len(items); i += 2 {
					half = append(half, items[i])
				}
				tx, err := pool.Begin(ctx)
				require.NoError(b, err)
				_, err = effectsdb.EnqueueItems(ctx, tx, half)
				require.NoError(b, err)
				require.NoError(b, tx.Commit(ctx))
			}
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				tx, err := pool.Begin(ctx)
				require.NoError(b, err)
				res, err := effectsdb.EnqueueItems(ctx, tx, items)
				require.NoError(b, err)
				require.Equal(b, stored, res[0].Duplicate)
				require.NoError(b, tx.Rollback(ctx))
			}
		})
	}
}
