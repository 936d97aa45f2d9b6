package pgtest

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
)

// Without IDEM_CITUS_URL, or with a coordinator that does not answer, a Citus test
// fails (it is never skipped) and says how to start the cluster.
func TestCitusURLFailsWithHowToStart(t *testing.T) {
	rec := &recorder{TB: t}
	t.Setenv(CitusURLVar, "")
	rec.call(func() { CitusURL(rec) })
	t.Setenv(CitusURLVar, "postgres://postgres:citus-s3cret@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=2")
	rec.call(func() { CitusURL(rec) })
	require.Len(t, rec.msgs, 2, "both calls failed: %q", rec.msgs)
	require.Contains(t, rec.msgs[0], "IDEM_CITUS_URL is unset")
	require.Contains(t, rec.msgs[1], "the Citus coordinator is not reachable at postgres://postgres:xxxxx@127.0.0.1:1/postgres")
	require.NotContains(t, rec.msgs[1], "citus-s3cret")
	for _, m := range rec.msgs {
		require.Contains(t, m, `eval "$(scripts/services start citus)"`)
	}
}

// citusTenants are enough tenants that, over the default 32 shards, both workers
// hold some of them.
const citusTenants = 24

// createCitusLedger creates accounts, distributed by tenant, and entries,
// distributed by tenant and colocated with accounts, with a foreign key that
// includes tenant; one account with one entry for each of citusTenants tenants.
func createCitusLedger(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	release := CitusDDL(t)
	defer release()
	for _, sql := range []string{
		`CREATE TABLE accounts (tenant text NOT NULL, id bigint NOT NULL, owner text NOT NULL, PRIMARY KEY (tenant, id))`,
		`SELECT create_distributed_table('accounts', 'tenant')`,
		`CREATE TABLE entries (tenant text NOT NULL, id bigint NOT NULL, account bigint NOT NULL, amount bigint NOT NULL,
			PRIMARY KEY (tenant, id), FOREIGN KEY (tenant, account) REFERENCES accounts (tenant, id))`,
		`SELECT create_distributed_table('entries', 'tenant', colocate_with => 'accounts')`,
	} {
		_, err := pool.Exec(ctx, sql)
		require.NoError(t, err, sql)
	}
	for i := range citusTenants {
		tenant := fmt.Sprintf("tenant-%02d", i)
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		_, err = tx.Exec(ctx, `INSERT INTO accounts (tenant, id, owner) VALUES ($1, 1, $2)`, tenant, "owner of "+tenant)
		require.NoError(t, err)
		_, err = tx.Exec(ctx, `INSERT INTO entries (tenant, id, account, amount) VALUES ($1, 1, 1, $2)`, tenant, 100+i)
		require.NoError(t, err)
		require.NoError(t, tx.Commit(ctx))
	}
}

// A table distributed by tenant and a colocated second table hold their rows on
// both workers: each worker holds shards of both, each tenant's rows of both tables
// sit on one worker, and the coordinator reads them all back.
func TestCitusDistributesByTenantOverBothWorkers(t *testing.T) {
	pool, schema := Citus(t)
	ctx := context.Background()
	createCitusLedger(t, pool)

	// Both tables have shards on both workers, and none on the coordinator.
	for _, table := range []string{"accounts", "entries"} {
		rows, err := pool.Query(ctx, `SELECT DISTINCT nodeport FROM citus_shards WHERE table_name = $1::regclass ORDER BY 1`,
			pgx.Identifier{schema, table}.Sanitize())
		require.NoError(t, err)
		ports, err := pgx.CollectRows(rows, pgx.RowTo[int])
		require.NoError(t, err)
		require.Equal(t, []int{CitusWorkerPort(t, 1), CitusWorkerPort(t, 2)}, ports, "the workers holding %s's shards", table)
	}
	require.Equal(t, 1, Count(t, pool, `SELECT count(DISTINCT colocationid) FROM pg_dist_partition
		WHERE logicalrelid IN ($1::regclass, $2::regclass)`,
		pgx.Identifier{schema, "accounts"}.Sanitize(), pgx.Identifier{schema, "entries"}.Sanitize()), "colocated")

	// Each tenant's account and entry are on the same worker, and the tenants
	// spread over both workers.
	perWorker := map[int]int{}
	for i := range citusTenants {
		tenant := fmt.Sprintf("tenant-%02d", i)
		w := CitusWorkerOf(t, pool, pgx.Identifier{schema, "accounts"}.Sanitize(), tenant)
		require.Equal(t, w, CitusWorkerOf(t, pool, pgx.Identifier{schema, "entries"}.Sanitize(), tenant), "tenant %s's tables are colocated", tenant)
		perWorker[w]++
	}
	require.Len(t, perWorker, 2, "tenants per worker: %v", perWorker)

	// Each worker's shard tables hold the rows of the tenants the metadata places
	// there, read on the worker itself.
	for n := 1; n <= 2; n++ {
		w, err := pgx.Connect(ctx, CitusWorkerURL(t, n))
		require.NoError(t, err)
		defer func() { _ = w.Close(ctx) }()
		for _, table := range []string{"accounts", "entries"} {
			rows, err := pool.Query(ctx, `SELECT shardid FROM citus_shards WHERE table_name = $1::regclass AND nodeport = $2`,
				pgx.Identifier{schema, table}.Sanitize(), CitusWorkerPort(t, n))
			require.NoError(t, err)
			shards, err := pgx.CollectRows(rows, pgx.RowTo[int64])
			require.NoError(t, err)
			total := 0
			for _, id := range shards {
				shard := pgx.Identifier{schema, fmt.Sprintf("%s_%d", table, id)}.Sanitize()
				total += Count(t, w, `SELECT count(*) FROM `+shard)
			}
			require.Equal(t, perWorker[n], total, "rows of %s on worker %d", table, n)
		}
	}

	// The coordinator reads every tenant's rows back, joined across the colocated
	// tables, one tenant at a time and all at once.
	var owner string
	var amount int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT a.owner, e.amount FROM accounts a JOIN entries e
		ON e.tenant = a.tenant AND e.account = a.id WHERE a.tenant = $1`, "tenant-07").Scan(&owner, &amount))
	require.Equal(t, "owner of tenant-07", owner)
	require.Equal(t, int64(107), amount)
	var n, sum int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*), sum(e.amount) FROM accounts a JOIN entries e
		ON e.tenant = a.tenant AND e.account = a.id`).Scan(&n, &sum))
	require.Equal(t, int64(citusTenants), n)
	require.Equal(t, int64(citusTenants*100+citusTenants*(citusTenants-1)/2), sum)
}

// A worker crashed through scripts/services stops serving its tenants while the
// other worker's tenants keep working; started again, it serves its tenants' rows,
// committed before the crash.
func TestCitusWorkerCrashAndRestart(t *testing.T) {
	pool, schema, ctl := CrashableCitus(t)
	ctx := context.Background()
	createCitusLedger(t, pool)
	tenantOn := map[int]string{}
	for i := range citusTenants {
		tenant := fmt.Sprintf("tenant-%02d", i)
		tenantOn[CitusWorkerOf(t, pool, pgx.Identifier{schema, "accounts"}.Sanitize(), tenant)] = tenant
	}
	require.Len(t, tenantOn, 2, "tenants on both workers")
	readOwner := func(tenant string) (string, error) {
		var owner string
		err := pool.QueryRow(ctx, `SELECT owner FROM accounts WHERE tenant = $1 AND id = 1`, tenant).Scan(&owner)
		return owner, err
	}

	ctl.CrashWorker(1)
	_, err := readOwner(tenantOn[1])
	require.Error(t, err, "a tenant of the crashed worker")
	owner, err := readOwner(tenantOn[2])
	require.NoError(t, err, "a tenant of the other worker")
	require.Equal(t, "owner of "+tenantOn[2], owner)
	_, err = pool.Exec(ctx, `INSERT INTO entries (tenant, id, account, amount) VALUES ($1, 2, 1, 5)`, tenantOn[2])
	require.NoError(t, err, "a write for a tenant of the other worker")

	ctl.StartWorker(1)
	owner, err = readOwner(tenantOn[1])
	require.NoError(t, err, "a tenant of the restarted worker")
	require.Equal(t, "owner of "+tenantOn[1], owner)

	ctl.RestartWorker(2)
	require.Equal(t, 2, Count(t, pool, `SELECT count(*) FROM entries WHERE tenant = $1`, tenantOn[2]),
		"the entry written while worker 1 was down survives worker 2's restart")
}
