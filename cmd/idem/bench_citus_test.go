package main

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/cmd/idem/internal/benchkit"
	"github.com/idemkit/idem/internal/pgtest"
)

// idem bench --citus runs each idem setup on plain Postgres, then on the Citus
// coordinator, the messages spread over tenants: nothing is lost or committed
// twice on either, the business table on Citus is distributed by tenant and
// colocated with idem's inbox, its tenants' rows are on both workers, and the
// backends' CPU (the workers' too) is read.
func TestBenchCompareCitus(t *testing.T) {
	t.Parallel()
	citus := pgtest.CitusURL(t)
	pgtest.Citus(t) // the shared lock: no worker crashes meanwhile
	schema := pgtest.NewSchemaName()
	ctx := context.Background()
	t.Cleanup(func() {
		pgtest.DropSchema(t, schema)
		release := pgtest.CitusDDL(t)
		defer release()
		conn, err := pgx.Connect(ctx, citus)
		require.NoError(t, err)
		defer func() { _ = conn.Close(ctx) }()
		_, err = conn.Exec(ctx, `DROP SCHEMA IF EXISTS `+pgx.Identifier{schema}.Sanitize()+` CASCADE`)
		require.NoError(t, err)
	})

	release := pgtest.CitusDDL(t) // the bench migrates and distributes on the coordinator
	r := runBenchCLI(t, "bench", "--citus", citus, "-n", "200", "--concurrency", "4", "--dup-rate", "0.2",
		"--tenants", "8", "--json", "--bench-schema", schema).ok(t)
	release()
	var out shardBenchJSON
	r.decode(t, &out)
	require.Len(t, out.Results, 4)
	for i, res := range out.Results {
		require.Equal(t, []benchkit.Setup{benchkit.PerMessage, benchkit.PerMessage, benchkit.GroupCommit, benchkit.GroupCommit}[i], res.Setup)
		require.Len(t, res.PerShard, 1)
		require.Equal(t, []string{"postgres", "citus"}[i%2], res.PerShard[0].Name)
		require.Zero(t, res.Lost, "%s on %s", res.Setup, res.PerShard[0].Name)
		require.Zero(t, res.CommittedTwice, "%s on %s", res.Setup, res.PerShard[0].Name)
		require.GreaterOrEqual(t, res.Deliveries, 200)
		require.NotNil(t, res.PgMicros, "%s on %s: Postgres runs on this host", res.Setup, res.PerShard[0].Name)
	}
	require.Empty(t, r.stderr, "with --json, stderr holds JSON only")

	conn, err := pgx.Connect(ctx, citus)
	require.NoError(t, err)
	defer func() { _ = conn.Close(ctx) }()
	biz, inbox := pgx.Identifier{schema, "bench_tenant_biz"}.Sanitize(), pgx.Identifier{schema, "inbox"}.Sanitize()
	var colocated bool
	require.NoError(t, conn.QueryRow(ctx, `SELECT b.colocationid = i.colocationid AND b.partmethod = 'h'
		FROM pg_dist_partition b, pg_dist_partition i WHERE b.logicalrelid = $1::regclass AND i.logicalrelid = $2::regclass`,
		biz, inbox).Scan(&colocated))
	require.True(t, colocated, "the business table is distributed by tenant, colocated with the inbox")
	var tenants, workers int
	require.NoError(t, conn.QueryRow(ctx, `SELECT count(DISTINCT tenant), count(DISTINCT p.groupid)
		FROM `+biz+` b JOIN pg_dist_placement p ON p.shardid = get_shard_id_for_distribution_column($1::regclass, b.tenant)`,
		biz).Scan(&tenants, &workers))
	require.Equal(t, 8, tenants)
	require.Equal(t, 2, workers, "the tenants' rows are on both workers")

	table := runBenchCLI(t, "bench", "--citus", citus, "-n", "20", "--concurrency", "2", "--tenants", "4", "--bench-schema", schema).ok(t)
	require.Contains(t, table.stdout, "× POSTGRES")
	require.Regexp(t, `\(b\) idem\s+citus\s+\d+`, table.stdout)

	plainAsCitus := runCLI(t, "bench", "--citus", pgtest.URL(), "--database-url", pgtest.URL(), "--bench-schema", schema)
	require.Equal(t, exitUsage, plainAsCitus.code)
	require.Contains(t, plainAsCitus.stderr, "--citus names the database of --database-url")
	withShards := runCLI(t, "bench", "--citus", citus, "--shard", "a="+pgtest.URL(), "--shard", "b="+citus, "--bench-schema", schema)
	require.Equal(t, exitUsage, withShards.code)
	require.Contains(t, withShards.stderr, "leave out the shard map")
	withSetups := runCLI(t, "bench", "--citus", citus, "--setups", "idem", "--bench-schema", schema)
	require.Equal(t, exitUsage, withSetups.code)
	require.Contains(t, withSetups.stderr, "leave out --setups")
}
