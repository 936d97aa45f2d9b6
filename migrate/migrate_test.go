package migrate_test

import (
	"context"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/migrate"
)

func TestMigratorUpTwiceIsNoop(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.Setup(t, pgtest.Options{NoMigrate: true})
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: schema})
	require.NoError(t, err)
	applied, err := m.Up(ctx)
	require.NoError(t, err)
	require.Equal(t, allVersions(), applied)
	applied, err = m.Up(ctx)
	require.NoError(t, err)
	require.Empty(t, applied)

	list, err := m.List(ctx)
	require.NoError(t, err)
	require.Len(t, list, len(migrate.Migrations()))
	require.True(t, list[0].Applied)
	require.Equal(t, "core", list[0].Name)
}

// Six migrators at once apply each step once, also where the role's or database's
// default_transaction_isolation is SERIALIZABLE: each migrator's transaction runs at
// READ COMMITTED, so one that waited for the lock sees what the holder applied.
func TestMigratorConcurrent(t *testing.T) {
	t.Parallel()
	for _, iso := range []string{"read committed", "repeatable read", "serializable"} {
		t.Run(iso, func(t *testing.T) {
			t.Parallel()
			testMigratorConcurrent(t, iso)
		})
	}
}

func testMigratorConcurrent(t *testing.T, iso string) {
	ctx := context.Background()
	schema := pgtest.NewSchemaName()
	t.Cleanup(func() { pgtest.DropSchema(t, schema) })
	pool := pgtest.NewPoolWith(t, "public", pgtest.Options{Settings: map[string]string{"default_transaction_isolation": iso}})
	var wg sync.WaitGroup
	total := make([]int, 6)
	errs := make([]error, 6)
	for i := range 6 {
		wg.Go(func() {
			m, err := migrate.New(migrate.Config{Pool: pool, Schema: schema})
			if err != nil {
				errs[i] = err
				return
			}
			applied, err := m.Up(ctx)
			total[i], errs[i] = len(applied), err
		})
	}
	wg.Wait()
	sum := 0
	for i := range 6 {
		require.NoError(t, errs[i])
		sum += total[i]
	}
	require.Equal(t, len(migrate.Migrations()), sum, "each step applied once across all processes")
}

func TestMigratorDownAndUpAgain(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.Setup(t)
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: schema})
	require.NoError(t, err)
	for want := len(migrate.Migrations()); want >= 1; want-- {
		v, err := m.Down(ctx)
		require.NoError(t, err)
		require.Equal(t, want, v, "Down reverts the newest step")
	}
	require.Equal(t, 0, pgtest.Count(t, pool, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename IN ('inbox','effects')`, schema))
	v, err := m.Down(ctx)
	require.NoError(t, err)
	require.Zero(t, v, "nothing left to revert")
	_, err = m.Up(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, pgtest.Count(t, pool, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename IN ('inbox','effects')`, schema))
}

func TestMigratorRefusesGapsAndUnknownVersions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.Setup(t)
	_, err := pool.Exec(ctx, `INSERT INTO idem_migrations (version, name) VALUES (99, 'future')`)
	require.NoError(t, err)
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: schema})
	require.NoError(t, err)
	_, err = m.Up(ctx)
	require.ErrorContains(t, err, "newer than this build knows")

	_, err = pool.Exec(ctx, `DELETE FROM idem_migrations; INSERT INTO idem_migrations (version, name) VALUES (2, 'x')`)
	require.NoError(t, err)
	_, err = m.Up(ctx)
	require.Error(t, err)
}

func TestEmbeddedMigrationsAreContiguous(t *testing.T) {
	t.Parallel()
	ms := migrate.Migrations()
	for i, m := range ms {
		require.Equal(t, i+1, m.Version)
		require.NotEmpty(t, m.Up)
		require.NotEmpty(t, m.Down)
	}
	// The files apply as they are with another tool: the marker is only a comment.
	for _, m := range ms {
		require.NotContains(t, strings.ReplaceAll(m.Up, "/* schema */", ""), "/*")
	}
}

func TestMigrationsApplyWithPlainSQLTool(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// What a user's own migration tool does: run the file as it is, with the
	// target schema first in search_path.
	pool, schema := pgtest.Setup(t, pgtest.Options{NoMigrate: true})
	for _, m := range migrate.Migrations() {
		_, err := pool.Exec(ctx, m.Up)
		require.NoError(t, err)
	}
	require.Equal(t, 2, pgtest.Count(t, pool, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename IN ('inbox','effects')`, schema))
}

// readOnlyPool is a pool whose every transaction is READ ONLY, as a read-only
// role's or a standby's would be.
func readOnlyPool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	require.NoError(t, err)
	cfg.MaxConns = 2
	cfg.ConnConfig.RuntimeParams["default_transaction_read_only"] = "on"
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// tableRows and columnValues are the rows of migrate.DownPlan's Tables and
// Columns.
type (
	tableRows = struct {
		Shard, Table string
		Rows         int64
	}
	columnValues = struct {
		Shard, Table, Column string
		Rows                 int64
	}
)

func schemaExists(t *testing.T, pool *pgxpool.Pool, schema string) bool {
	t.Helper()
	return pgtest.Count(t, pool, `SELECT count(*) FROM pg_namespace WHERE nspname = $1`, schema) == 1
}

// List, PlanDown and Down on a schema that does not exist create nothing: no
// schema, no migrations table.
func TestMigratorCreatesNothingUnlessUp(t *testing.T) {
	t.Parallel()
	pgtest.Require(t)
	ctx := context.Background()
	schema := pgtest.NewSchemaName()
	t.Cleanup(func() { pgtest.DropSchema(t, schema) })
	pool := pgtest.NewPool(t, "public", 2)
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: schema})
	require.NoError(t, err)

	list, err := m.List(ctx)
	require.NoError(t, err)
	require.Len(t, list, len(migrate.Migrations()))
	for _, s := range list {
		require.False(t, s.Applied)
	}
	plan, err := m.PlanDown(ctx)
	require.NoError(t, err)
	require.Zero(t, plan.Version)
	v, err := m.Down(ctx)
	require.NoError(t, err)
	require.Zero(t, v)
	require.False(t, schemaExists(t, pool, schema), "List, PlanDown or Down created the schema")
}

// List and PlanDown work where nothing may be written.
func TestMigratorListIsReadOnly(t *testing.T) {
	_, schema := pgtest.Setup(t)
	t.Parallel()
	ctx := context.Background()
	ro := readOnlyPool(t)
	m, err := migrate.New(migrate.Config{Pool: ro, Schema: schema})
	require.NoError(t, err)
	list, err := m.List(ctx)
	require.NoError(t, err)
	require.True(t, list[0].Applied)
	plan, err := m.PlanDown(ctx)
	require.NoError(t, err)
	require.Equal(t, len(migrate.Migrations()), plan.Version)

	missing := pgtest.NewSchemaName()
	m, err = migrate.New(migrate.Config{Pool: ro, Schema: missing})
	require.NoError(t, err)
	list, err = m.List(ctx)
	require.NoError(t, err)
	require.False(t, list[0].Applied)
	require.False(t, schemaExists(t, ro, missing))
}

// PlanDown shows the tables the newest migration's down drops, with their rows;
// Revert reverts exactly that step, and refuses when the schema moved on.
func TestMigratorPlanDownAndRevert(t *testing.T) {
	pool, schema := pgtest.Setup(t)
	t.Parallel()
	ctx := context.Background()
	_, err := pool.Exec(ctx, `INSERT INTO inbox (consumer, key, fingerprint, state, expires_at)
		SELECT 'c', 'k' || i, '\x00', 'completed', now() + interval '1 day' FROM generate_series(1, 3) i`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO effects (kind, key, fingerprint) VALUES ('email', 'a', '\x00'), ('email', 'b', '\x00')`)
	require.NoError(t, err)
	newest := len(migrate.Migrations())
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: schema})
	require.NoError(t, err)

	// One of the effects keeps a trace context (migration 005).
	_, err = pool.Exec(ctx, `UPDATE effects SET trace_context = '{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}' WHERE key = 'a'`)
	require.NoError(t, err)
	// One of the inbox rows holds a stored HTTP response (migration 003).
	_, err = pool.Exec(ctx, `UPDATE inbox SET response_status = 201, response_body = '\x7b7d' WHERE key = 'k1'`)
	require.NoError(t, err)

	// One effect is dead in a failure group, and one repair action is recorded
	// (migration 006).
	_, err = pool.Exec(ctx, `UPDATE effects SET state = 'dead', error_masked = 'x', error_group = '\x0102030405060708', dead_at = now() WHERE key = 'b'`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO failure_actions (action, source, group_id, place, tenant, through, affected, who, why)
		VALUES ('retry', 'effects', '\x0102030405060708', 'email', '', now(), 1, 'ops', 'fixed')`)
	require.NoError(t, err)

	require.Equal(t, 8, newest, "the plans below are migrations 008's, 007's, 006's, 005's, 004's and 003's; update this test for a new migration")
	// 008's down only brings back the trigger that woke the dispatchers.
	plan, err := m.PlanDown(ctx)
	require.NoError(t, err)
	require.Equal(t, 8, plan.Version)
	require.Empty(t, plan.Tables)
	require.Empty(t, plan.Columns)
	_, err = m.Revert(ctx, 8)
	require.NoError(t, err)

	// 007's down drops two indexes, and no data.
	plan, err = m.PlanDown(ctx)
	require.NoError(t, err)
	require.Equal(t, 7, plan.Version)
	require.Empty(t, plan.Tables)
	require.Empty(t, plan.Columns)
	_, err = m.Revert(ctx, 7)
	require.NoError(t, err)
	newest = 6

	plan, err = m.PlanDown(ctx)
	require.NoError(t, err)
	require.Equal(t, newest, plan.Version)
	require.Equal(t, []tableRows{{Table: "failure_actions", Rows: 1}}, plan.Tables, "006's down drops the audit of repair actions")
	require.Equal(t, []columnValues{
		{Table: "effects", Column: "dead_at", Rows: 1},
		{Table: "effects", Column: "error_group", Rows: 1},
		{Table: "effects", Column: "error_masked", Rows: 1},
		{Table: "effects", Column: "error_code", Rows: 0},
		{Table: "inbox", Column: "error_group", Rows: 0},
		{Table: "inbox", Column: "error_masked", Rows: 0},
	}, plan.Columns)
	// A discarded effect stops the revert, which then changes nothing.
	_, err = pool.Exec(ctx, `UPDATE effects SET state = 'discarded', done_at = now() WHERE key = 'b'`)
	require.NoError(t, err)
	_, err = m.Revert(ctx, newest)
	require.ErrorContains(t, err, "some effects are discarded")
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM failure_actions`))
	_, err = pool.Exec(ctx, `UPDATE effects SET state = 'dead' WHERE key = 'b'`)
	require.NoError(t, err)
	_, err = m.Revert(ctx, newest)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE effects SET state = 'discarded' WHERE key = 'b'`)
	require.ErrorContains(t, err, "effects_state_check", "the old CHECK is back")

	plan, err = m.PlanDown(ctx)
	require.NoError(t, err)
	require.Equal(t, 5, plan.Version)
	require.Empty(t, plan.Tables, "005's down drops no table")
	require.Equal(t, []columnValues{{Table: "effects", Column: "trace_context", Rows: 1}}, plan.Columns,
		"005's down drops the effects' trace context, and says so")
	_, err = m.Revert(ctx, 5)
	require.NoError(t, err)

	plan, err = m.PlanDown(ctx)
	require.NoError(t, err)
	require.Equal(t, 4, plan.Version)
	require.Equal(t, []tableRows{{Table: "commit_guard", Rows: 0}}, plan.Tables, "004's down drops the commit guard, which never holds a committed row")
	require.Empty(t, plan.Columns)
	_, err = m.Revert(ctx, 4)
	require.NoError(t, err)

	plan, err = m.PlanDown(ctx)
	require.NoError(t, err)
	require.Equal(t, 3, plan.Version)
	require.Empty(t, plan.Tables, "003's down drops no table")
	require.Equal(t, []columnValues{
		{Table: "inbox", Column: "response_ref", Rows: 0},
		{Table: "inbox", Column: "response_body", Rows: 1},
		{Table: "inbox", Column: "response_headers", Rows: 0},
		{Table: "inbox", Column: "response_status", Rows: 1},
	}, plan.Columns, "the plan names the dropped columns and how many rows hold data in each")
	require.Contains(t, plan.SQL, `ALTER TABLE "`+schema+`".inbox`)

	_, err = m.Revert(ctx, 4)
	require.ErrorContains(t, err, "another process migrated it")
	require.Equal(t, 3, pgtest.Count(t, pool, `SELECT count(*) FROM inbox`), "a refused revert dropped something")

	for v := 3; v >= 1; v-- {
		done, err := m.Revert(ctx, v)
		require.NoError(t, err)
		require.Equal(t, v, done.Version)
		if v == 1 {
			require.Equal(t, []tableRows{{Table: "effects", Rows: 2}, {Table: "inbox", Rows: 3}}, done.Tables)
			require.Contains(t, done.SQL, `DROP TABLE IF EXISTS "`+schema+`".inbox`)
		}
	}
	require.Zero(t, pgtest.Count(t, pool, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename IN ('inbox', 'effects')`, schema))
	plan, err = m.PlanDown(ctx)
	require.NoError(t, err)
	require.Zero(t, plan.Version)
}
