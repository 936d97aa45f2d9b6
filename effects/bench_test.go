package effects_test

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/effects"
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
		_, err = effects.EnqueueScoped(ctx, tx, effects.Scope{Schema: schema}, effects.Effect{Kind: "lat", Key: fmt.Sprint(i)})
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
