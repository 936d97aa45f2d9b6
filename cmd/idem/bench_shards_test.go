package main

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/cmd/idem/internal/benchkit"
	"github.com/idemkit/idem/internal/pgtest"
)

// idem bench over a shard map of 3 (repeated --shard, or a --shards file) runs
// each idem setup on the first shard cluster, then on the three: every delivery
// is counted on the shard its tenant routes to, each shard's backends' CPU is
// read, and nothing is lost or committed twice. It works in its own schema only:
// the map's schema is left as it was.
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
	// The map's own schema on each cluster, with a row of its own in it.
	mapSchema := pgtest.NewSchemaName()
	var shardFlags []string
	file := shardsFile{}
	for i, u := range urls {
		conn, err := pgx.Connect(context.Background(), u)
		require.NoError(t, err)
		_, err = conn.Exec(context.Background(), `CREATE SCHEMA `+mapSchema+`; CREATE TABLE `+mapSchema+`.mine (x int); INSERT INTO `+mapSchema+`.mine VALUES (1)`)
		require.NoError(t, err)
		_ = conn.Close(context.Background())
		name := []string{"eu", "us", "ap"}[i]
		shardFlags = append(shardFlags, "--shard", name+"="+u+",schema="+mapSchema)
		file.Shards = append(file.Shards, shardSpec{Name: name, URL: u, Schema: mapSchema})
	}
	path := filepath.Join(t.TempDir(), "shards.json")
	b, err := json.Marshal(file)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(path, b, 0o600))
	t.Cleanup(func() {
		for _, u := range urls {
			conn, err := pgx.Connect(context.Background(), u)
			if err != nil {
				t.Errorf("drop %s: %v", mapSchema, err)
				continue
			}
			var tables []string
			rows, err := conn.Query(context.Background(), `SELECT tablename FROM pg_tables WHERE schemaname = $1`, mapSchema)
			require.NoError(t, err)
			tables, err = pgx.CollectRows(rows, pgx.RowTo[string])
			require.NoError(t, err)
			require.Equal(t, []string{"mine"}, tables, "the bench left the map's schema as it was")
			_, err = conn.Exec(context.Background(), `DROP SCHEMA `+mapSchema+` CASCADE`)
			require.NoError(t, err)
			_ = conn.Close(context.Background())
		}
	})

	r := runBenchCLI(t, append([]string{"bench", "-n", "300",
		"--concurrency", "4", "--dup-rate", "0.2", "--tenants", "12", "--json", "--bench-schema", schema}, shardFlags...)...).ok(t)
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
		for j, s := range res.PerShard {
			require.Equal(t, []string{"eu", "us", "ap"}[j], s.Name, "the map's names")
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

	table := runBenchCLI(t, "bench", "--shards", path, "-n", "30", "--concurrency", "2", "--tenants", "6", "--bench-schema", schema).ok(t)
	require.Contains(t, table.stdout, "× 1 SHARD")
	require.Regexp(t, `eu \d+, \d+, [\d.]+; us \d+, \d+, [\d.]+; ap `, table.stdout)

	one := runCLI(t, "bench", shardFlags[0], shardFlags[1], "--bench-schema", schema)
	require.Equal(t, exitUsage, one.code)
	require.Contains(t, one.stderr, "needs a map of at least 2 shards")
	twice := runCLI(t, "bench", "--shard", "a="+urls[0], "--shard", "b="+urls[0], "--bench-schema", schema)
	require.Equal(t, exitUsage, twice.code)
	require.Contains(t, twice.stderr, "names one database twice")
	theirs := runCLI(t, append([]string{"bench", "--bench-schema", mapSchema}, shardFlags...)...)
	require.Equal(t, exitUsage, theirs.code)
	require.Contains(t, theirs.stderr, "the bench works only in a schema of its own")
	both := runCLI(t, append([]string{"bench", "--setups", "idem", "--bench-schema", schema}, shardFlags...)...)
	require.Equal(t, exitUsage, both.code)
	require.Contains(t, both.stderr, "leave out --setups")
	for _, gone := range []string{"--compare-shards", "--shard-urls"} {
		r := runCLI(t, "bench", gone, "3")
		require.Equal(t, exitUsage, r.code, gone)
		require.Contains(t, r.stderr, "unknown flag: "+gone) // pflag's words for an undefined flag
	}
}
