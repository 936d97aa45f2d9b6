package benchkit_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/cmd/idem/internal/benchkit"
	"github.com/idemkit/idem/internal/pgtest"
)

// TestSetupsAgree runs a small workload with duplicates under every setup: each
// must lose nothing, and every setup but the bare handler must write one business
// row per message (the in-memory deduplicator too, within one process).
func TestSetupsAgree(t *testing.T) {
	t.Parallel()
	_, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 2})
	require.NoError(t, benchkit.Prepare(context.Background(), benchkit.Options{DatabaseURL: pgtest.URL(), Schema: schema}))
	brokers := externalBrokers()
	ran := 0
	for _, s := range benchkit.AllSetups {
		if s == benchkit.KafkaExternal && brokers == nil {
			t.Log("kafka-external not run: KAFKA_BROKERS is not set (TestKafkaExternal runs it on kfake)")
			continue
		}
		res, err := benchkit.Run(context.Background(), s, benchkit.Options{
			DatabaseURL: pgtest.URL(), Schema: schema, N: 500, DupRate: 0.3, Concurrency: 8,
			KafkaBrokers: brokers, KafkaPartitions: 4, KafkaInFlight: 16,
		})
		require.NoError(t, err, s)
		if s == benchkit.Drain {
			// Every setup before enqueued one effect per message.
			require.Equal(t, ran*500, res.Messages)
			require.GreaterOrEqual(t, res.Deliveries, res.Messages)
			t.Logf("%-13s %8.0f effects/s p50 %v p99 %v (commit to send)", s, res.MsgsPerSec, res.P50, res.P99)
			continue
		}
		ran++
		require.Zero(t, res.Lost, s)
		if s == benchkit.Bare {
			require.Equal(t, res.Deliveries-500, res.CommittedTwice, "the bare handler has no dedupe")
		} else {
			require.Zero(t, res.CommittedTwice, s)
		}
		require.Greater(t, res.Deliveries, 500, s)
		require.Positive(t, res.MsgsPerSec)
		t.Logf("%-13s %8.0f msgs/s p50 %v p99 %v commits/msg %.2f %s", s, res.MsgsPerSec, res.P50, res.P99, res.CommitsPerMsg, res.Broker)
	}
}

// TestDrainTopsUpAFreshBacklog: the Drain setup adds effects of its own up to
// DrainBacklog, and drains them from a table that was never analyzed.
func TestDrainTopsUpAFreshBacklog(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 2})
	ctx := context.Background()
	o := benchkit.Options{DatabaseURL: pgtest.URL(), Schema: schema, N: 100, Concurrency: 4, DrainBacklog: 3000}
	require.NoError(t, benchkit.Prepare(ctx, o))
	_, err := benchkit.Run(ctx, benchkit.Bare, o)
	require.NoError(t, err)
	res, err := benchkit.Run(ctx, benchkit.Drain, o)
	require.NoError(t, err)
	require.Equal(t, 3000, res.Messages)
	require.Equal(t, 3000, res.Deliveries)
	var analyzed bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT coalesce(last_analyze, last_autoanalyze) IS NOT NULL
		FROM pg_stat_user_tables WHERE relid = 'effects'::regclass`).Scan(&analyzed))
	require.False(t, analyzed)
	require.Zero(t, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE state <> 'done'`))
}

func BenchmarkSetups(b *testing.B) {
	_, schema := pgtest.Setup(b, pgtest.Options{MaxConns: 2})
	ctx := context.Background()
	require.NoError(b, benchkit.Prepare(ctx, benchkit.Options{DatabaseURL: pgtest.URL(), Schema: schema}))
	results := map[benchkit.Setup]benchkit.Result{}
	brokers := externalBrokers()
	for _, s := range benchkit.AllSetups {
		if s == benchkit.KafkaExternal && brokers == nil {
			b.Log("kafka-external not run: KAFKA_BROKERS is not set")
			continue
		}
		b.Run(string(s), func(b *testing.B) {
			res, err := benchkit.Run(ctx, s, benchkit.Options{
				DatabaseURL: pgtest.URL(), Schema: schema, N: max(b.N, 2000), DupRate: 0.1, Concurrency: 16,
				KafkaBrokers: brokers,
			})
			require.NoError(b, err)
			results[s] = res
			b.ReportMetric(res.MsgsPerSec, "msgs/s")
			b.ReportMetric(float64(res.P99.Microseconds()), "p99-µs")
			b.ReportMetric(res.CommitsPerMsg, "commits/msg")
			if bare, ok := results[benchkit.Bare]; ok && s != benchkit.Bare {
				b.ReportMetric(res.MsgsPerSec/bare.MsgsPerSec, "x-bare")
			}
		})
	}
}

// A benchmark that cannot reach its database says so without the password, for a
// DSN that does not parse and for a server that does not answer.
func TestErrorsHideThePassword(t *testing.T) {
	t.Parallel()
	const secret = "bench-s3cret-pw"
	for _, url := range []string{
		"postgres://postgres:" + secret + "@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=2",
		"postgres://postgres:" + secret + "@127.0.0.1:notaport/postgres",
		"host=127.0.0.1 port=1 user=postgres password=" + secret + " connect_timeout=2",
	} {
		o := benchkit.Options{DatabaseURL: url, Schema: "t_nowhere", N: 10}
		err := benchkit.Prepare(context.Background(), o)
		require.Error(t, err, url)
		require.NotContains(t, err.Error(), secret)
		for _, s := range []benchkit.Setup{benchkit.Bare, benchkit.Drain} {
			_, err = benchkit.Run(context.Background(), s, o)
			require.Error(t, err, url)
			require.NotContains(t, err.Error(), secret)
		}
	}
}
