package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/migrate"
)

// withParam adds a query parameter to a URL DSN.
func withParam(url, kv string) string {
	if strings.Contains(url, "?") {
		return url + "&" + kv
	}
	return url + "?" + kv
}

func schemaExists(t *testing.T, b *bundle, schema string) bool {
	t.Helper()
	return pgtest.Count(t, b.pool, `SELECT count(*) FROM pg_namespace WHERE nspname = $1`, schema) == 1
}

// migrate list only reads: on a schema that does not exist it lists every
// migration as not applied and creates nothing, and it works where every
// transaction is read-only. migrate down on a missing schema creates nothing.
func TestMigrateListIsReadOnly(t *testing.T) {
	b := setup(t)
	readOnly := withParam(pgtest.URL(), "default_transaction_read_only=on")
	missing := pgtest.NewSchemaName()
	t.Cleanup(func() { pgtest.DropSchema(t, missing) })

	r := runCLI(t, "migrate", "list", "--schema", missing, "--database-url", readOnly).ok(t)
	require.Regexp(t, `001\s+core\s+no\s+-`, r.stdout)
	r = runCLI(t, "migrate", "list", "--json", "--schema", missing, "--database-url", readOnly).ok(t)
	var list []migrationJSON
	r.decode(t, &list)
	require.Len(t, list, len(migrate.Migrations()))
	require.False(t, list[0].Applied)
	for _, args := range [][]string{{"migrate", "down"}, {"migrate", "down", "--yes"}} {
		r = runCLI(t, append(args, "--schema", missing, "--database-url", pgtest.URL())...).ok(t)
		require.Equal(t, "schema "+missing+" has no migration to revert\n", r.stdout)
	}
	require.False(t, schemaExists(t, b, missing), "migrate list or down created the schema")

	r = runCLI(t, "migrate", "list", "--schema", b.schema, "--database-url", readOnly).ok(t)
	require.Regexp(t, `001\s+core\s+yes\s+20`, r.stdout)
}

// migrate down shows the tables it will drop with their rows, and drops them
// only with --yes or the schema name typed on a terminal.
func TestMigrateDownShowsWhatItDropsAndAsks(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	// Down to the first migration, whose down drops the inbox and the effects.
	m, err := migrate.New(migrate.Config{Pool: b.pool, Schema: b.schema})
	require.NoError(t, err)
	for v := len(migrate.Migrations()); v > 1; v-- {
		_, err := m.Revert(ctx, v)
		require.NoError(t, err)
	}
	_, err = b.pool.Exec(ctx, `INSERT INTO inbox (consumer, key, fingerprint, state, expires_at)
		SELECT 'payments', 'k' || i, '\x00', 'completed', now() + interval '1 day' FROM generate_series(1, 3) i;
		INSERT INTO effects (kind, key, fingerprint) VALUES ('email', 'a', '\x00'), ('email', 'b', '\x00')`)
	require.NoError(t, err)
	const shown = "reverting 001_core in schema %s: dropping table effects (2 rows), table inbox (3 rows)"
	tablesLeft := func() int {
		return pgtest.Count(t, b.pool, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename IN ('inbox', 'effects')`, b.schema)
	}

	// No terminal, no --yes: shown, refused, nothing changed.
	r := b.idem("migrate", "down")
	require.Equal(t, exitUsage, r.code, r.stderr)
	require.Contains(t, r.stderr, strings.Replace(shown, "%s", b.schema, 1))
	require.Contains(t, r.stderr, "nothing was changed")
	require.Contains(t, r.stderr, "run it again with --yes")
	require.Equal(t, 2, tablesLeft())

	// A terminal, and the wrong answer.
	onTerminal := func(answer string, more ...string) result {
		var out, errOut bytes.Buffer
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		code := runOn(ctx, append([]string{"migrate", "down", "--database-url", pgtest.URL(), "--schema", b.schema}, more...), strings.NewReader(answer), &out, &errOut)
		return result{code, out.String(), errOut.String()}
	}
	// With --json it never asks, even on a terminal: the error holds the plan.
	r = onTerminal(b.schema+"\n", "--json")
	require.Equal(t, exitUsage, r.code, r.stderr)
	e := decodeError(t, r.stderr)
	require.Equal(t, "confirmation_required", e.Code)
	require.Equal(t, 2, tablesLeft())
	r = onTerminal("y\n")
	require.Equal(t, exitFailure, r.code, r.stderr)
	require.Contains(t, r.stderr, "Type the schema name ("+b.schema+") to revert")
	require.Contains(t, r.stderr, "cancelled; nothing was changed")
	require.Equal(t, 2, tablesLeft())

	// The right answer.
	r = onTerminal(b.schema + "\n").ok(t)
	require.Equal(t, "reverted 001_core in schema "+b.schema+": table effects (2 rows), table inbox (3 rows)\n", r.stdout)
	require.Zero(t, tablesLeft())

	// --yes, for scripts, with the figures in JSON.
	b.idem("migrate", "up").ok(t)
	var down struct {
		Reverted int           `json:"reverted"`
		Dropped  []droppedJSON `json:"dropped"`
	}
	b.idem("migrate", "down", "--yes", "--json").ok(t).decode(t, &down)
	require.Equal(t, len(migrate.Migrations()), down.Reverted)

	require.Equal(t, exitUsage, b.idem("migrate", "up", "--yes").code, "--yes is for down only")
}

// A down migration that drops columns, not tables (003 drops the stored HTTP
// responses), says so, with how many rows hold data in each, before it asks.
func TestMigrateDownShowsDroppedColumns(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	require.Equal(t, 8, len(migrate.Migrations()), "this test reads migrations 008's, 007's, 006's, 005's and 003's plans; update it for a new migration")
	m, err := migrate.New(migrate.Config{Pool: b.pool, Schema: b.schema})
	require.NoError(t, err)
	// 008 drops no table or column (it brings back a trigger).
	_, err = m.Revert(ctx, 8)
	require.NoError(t, err)
	// 007 drops two indexes: nothing to warn about, no data lost.
	plan, err := m.PlanDown(ctx)
	require.NoError(t, err)
	require.Equal(t, 7, plan.Version)
	require.Empty(t, plan.Tables)
	require.Empty(t, plan.Columns)
	_, err = m.Revert(ctx, 7)
	require.NoError(t, err)
	// 006 drops the audit of repair actions, with its rows.
	r := b.idem("migrate", "down")
	require.Equal(t, exitUsage, r.code, r.stderr)
	require.Contains(t, r.stderr, "reverting 006_failure_groups in schema "+b.schema)
	require.Contains(t, r.stderr, "failure_actions")
	_, err = m.Revert(ctx, 6)
	require.NoError(t, err)
	// 005 drops the effects' trace context (the effects stay).
	_, err = b.pool.Exec(ctx, `INSERT INTO effects (kind, key, fingerprint, trace_context)
		VALUES ('email', 'a', '\x00', '{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}'),
		       ('email', 'b', '\x00', NULL)`)
	require.NoError(t, err)
	r = b.idem("migrate", "down")
	require.Equal(t, exitUsage, r.code, r.stderr)
	require.Contains(t, r.stderr, "reverting 005_trace_context in schema "+b.schema+
		": dropping column effects.trace_context (1 rows hold a value)")
	require.Contains(t, r.stderr, "nothing was changed")
	require.Equal(t, 1, pgtest.Count(t, b.pool, `SELECT count(*) FROM effects WHERE trace_context IS NOT NULL`))

	// 004 goes next: its down drops only the commit guard, which never holds a row.
	for _, v := range []int{5, 4} {
		_, err = m.Revert(ctx, v)
		require.NoError(t, err)
	}
	require.Equal(t, 2, pgtest.Count(t, b.pool, `SELECT count(*) FROM effects`), "reverting 005 kept the effects")
	_, err = b.pool.Exec(ctx, `INSERT INTO inbox (consumer, key, fingerprint, state, expires_at, response_status, response_body)
		VALUES ('POST /payments', 'k1', '\x00', 'completed', now() + interval '1 day', 201, '\x7b7d'),
		       ('POST /payments', 'k2', '\x00', 'completed', now() + interval '1 day', NULL, NULL)`)
	require.NoError(t, err)

	r = b.idem("migrate", "down")
	require.Equal(t, exitUsage, r.code, r.stderr)
	require.Contains(t, r.stderr, "reverting 003_http_responses in schema "+b.schema+
		": dropping column inbox.response_ref (0 rows hold a value), column inbox.response_body (1 rows hold a value)")
	require.Contains(t, r.stderr, "nothing was changed")
	require.Equal(t, 1, pgtest.Count(t, b.pool, `SELECT count(*) FROM inbox WHERE response_body IS NOT NULL`))

	var down map[string]any
	b.idem("migrate", "down", "--yes", "--json").ok(t).decode(t, &down)
	require.EqualValues(t, 3, down["reverted"])
	require.Contains(t, down["dropped_columns"], map[string]any{"table": "inbox", "column": "response_status", "rows_with_value": float64(1)})
}

// migrate up --citus, on the Citus coordinator, applies the migrations and
// distributes the inbox by tenant; on plain Postgres it fails with no_citus and
// applies nothing; with down or list it is a usage error.
func TestMigrateUpCitus(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.Citus(t, pgtest.Options{MaxConns: 2})
	coord := pgtest.CitusURL(t)
	release := pgtest.CitusDDL(t)
	r := runCLI(t, "migrate", "up", "--citus", "--json", "--schema", schema, "--database-url", coord).ok(t)
	release()
	var up struct{ Applied []int }
	r.decode(t, &up)
	require.Len(t, up.Applied, len(migrate.Migrations()))
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM pg_dist_partition
		WHERE logicalrelid = to_regclass($1) AND column_to_column_name(logicalrelid, partkey) = 'tenant'`, schema+".inbox"))

	missing := pgtest.NewSchemaName()
	t.Cleanup(func() { pgtest.DropSchema(t, missing) })
	r = runCLI(t, "migrate", "up", "--citus", "--json", "--schema", missing, "--database-url", pgtest.URL())
	require.Equal(t, exitFailure, r.code, r.stderr)
	require.Contains(t, r.stdout+r.stderr, "no_citus")
	for _, action := range []string{"down", "list"} {
		r = runCLI(t, "migrate", action, "--citus", "--schema", missing, "--database-url", pgtest.URL())
		require.Equal(t, exitUsage, r.code, r.stderr)
	}
}
