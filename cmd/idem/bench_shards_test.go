package main

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/cmd/idem/internal/benchkit"
	"github.com/idemkit/idem/internal/pgtest"
)

// idem bench --compare-shards 3 runs each idem setup on one shard cluster, then on
// three: every delivery is counted on the shard its tenant routes to, each shard's
// backends' CPU is read, and nothing is lost or committed twice.
func TestBenchCompareShards(t *testing.T) {
	t.Parallel()
	pgtest.Shards(t, pgtest.Options{NoMigrate: true}) // the shared lock: no cluster crashes meanwhile
	urls := pgtest.ShardURLs(t)
	require.GreaterOrEqual(t, len(urls), 3)
	schema := pgtest.NewSchemaName()
	t.Cleanup(func() {
		for _, u := range urls {
			conn, err := pgx.Connect(context.Background(), u)
			if err != nil {
				t.Errorf("drop %s: %v", schema, err)
				continue
			}
			_, err = conn.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+pgx.Identifier{schema}.Sanitize()+` CASCADE`)
			require.NoError(t, err)
			_ = conn.Close(context.Background())
		}
	})
	r := runBenchCLI(t, "bench", "--compare-shards", "3", "--shard-urls", strings.Join(urls, ","), "-n", "300",
		"--concurrency", "4", "--dup-rate", "0.2", "--tenants", "12", "--json", "--bench-schema", schema).ok(t)
	var out shardBenchJSON
	r.decode(t, &out)
	require.Len(t, out.Results, 4)
	for i, res := range out.Results {
		require.Equal(t, []benchkit.Setup{benchkit.PerMessage, benchkit.PerMessage, benchkit.GroupCommit, benchkit.GroupCommit}[i], res.Setup)
		require.Equal(t, []int{1, 3}[i%2], res.Shards)
		require.Len(t, res.PerShard, res.Shards)
		require.Zero(t, res.Lost, "%s on %d shards", res.Setup, res.Shards)
		require.Zero(t, res.CommittedTwice, "%s on %d shards", res.Setup, res.Shards)
		require.Positive(t, res.MsgsPerSec)
		require.GreaterOrEqual(t, res.Deliveries, 300)
		sum := 0
		for _, s := range res.PerShard {
			require.Positive(t, s.Deliveries, "shard %s of %d got no tenant", s.Name, res.Shards)
			sum += s.Deliveries
			// The shard clusters run on this host: their backends are read.
			require.NotNil(t, s.PgMicros, "shard %s", s.Name)
			require.Positive(t, *s.PgMicros, "shard %s", s.Name)
		}
		require.Equal(t, res.Deliveries, sum)
		require.NotNil(t, res.PgMicros)
	}
	require.Empty(t, r.stderr, "with --json, stderr holds JSON only")

	table := runBenchCLI(t, "bench", "--compare-shards", "3", "--shard-urls", strings.Join(urls, ","), "-n", "30",
		"--concurrency", "2", "--tenants", "6", "--bench-schema", schema).ok(t)
	require.Contains(t, table.stdout, "× 1 SHARD")
	require.Regexp(t, `s1 \d+, \d+, [\d.]+; s2 \d+, \d+, [\d.]+; s3 `, table.stdout)

	few := runCLI(t, "bench", "--compare-shards", "3", "--shard-urls", urls[0], "--bench-schema", schema)
	require.Equal(t, exitUsage, few.code)
	require.Contains(t, few.stderr, "needs 3 shard URLs")
	twice := runCLI(t, "bench", "--compare-shards", "2", "--shard-urls", urls[0]+","+urls[0], "--bench-schema", schema)
	require.Equal(t, exitUsage, twice.code)
	require.Contains(t, twice.stderr, "names one database twice")
	both := runCLI(t, "bench", "--compare-shards", "3", "--setups", "idem", "--bench-schema", schema)
	require.Equal(t, exitUsage, both.code)
}
