package main

// docs/migrations.md promises that the migration files work with goose and golang-migrate
// as well as with idem's own Migrator. These tests apply them with each tool as a
// library, into a fresh schema chosen by search_path alone (as the
// commands of docs/migrations.md do), and check that the schema each tool makes is the Migrator's:
// tables, columns, indexes, constraints, the trigger and its function, compared
// through the catalog.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"path"
	"strings"
	"testing"

	gomigrate "github.com/golang-migrate/migrate/v4"
	_ "github.com/golang-migrate/migrate/v4/database/pgx/v5" // the pgx5:// driver
	_ "github.com/golang-migrate/migrate/v4/source/file"     // the file:// source
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/migrate"
)

// bookkeeping are the tables in which each tool records what it applied; they
// are the tools' own and are left out of the comparison.
var bookkeeping = []string{"idem_migrations", "goose_db_version", "schema_migrations"}

// catalog is what a schema holds, as text that does not name the schema.
type catalog struct {
	Relations   []string
	Columns     []string
	Indexes     []string
	Constraints []string
	Triggers    []string
	Functions   []string
}

// readCatalog reads schema's relations, columns (in column order), indexes,
// constraints, triggers and functions, leaving out the tools' bookkeeping tables
// and what belongs to them.
func readCatalog(t *testing.T, db interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}, schema string) catalog {
	t.Helper()
	ctx := context.Background()
	list := func(query string, args ...any) []string {
		t.Helper()
		rows, err := db.Query(ctx, query, append([]any{schema}, args...)...)
		require.NoError(t, err)
		out, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err, query)
		for i, s := range out {
			out[i] = strings.ReplaceAll(s, schema, "<schema>")
		}
		return out
	}
	// $2: relations whose name starts with a bookkeeping table's (its index, its
	// identity sequence) are the tool's.
	const notBookkeeping = `NOT EXISTS (SELECT 1 FROM unnest($2::text[]) b WHERE c.relname LIKE b || '%')`
	return catalog{
		Relations: list(`SELECT c.relname || ' ' || c.relkind::text FROM pg_class c
			JOIN pg_namespace n ON n.oid = c.relnamespace
			WHERE n.nspname = $1 AND `+notBookkeeping+` ORDER BY 1`, bookkeeping),
		Columns: list(`SELECT c.relname || '.' || a.attname || ' ' || format_type(a.atttypid, a.atttypmod)
				|| CASE WHEN a.attnotnull THEN ' NOT NULL' ELSE '' END
				|| coalesce(' DEFAULT ' || pg_get_expr(d.adbin, d.adrelid), '')
				|| ' identity=' || a.attidentity::text || ' generated=' || a.attgenerated::text
			FROM pg_attribute a
			JOIN pg_class c ON c.oid = a.attrelid
			JOIN pg_namespace n ON n.oid = c.relnamespace
			LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
			WHERE n.nspname = $1 AND c.relkind IN ('r', 'p') AND a.attnum > 0 AND NOT a.attisdropped
				AND `+notBookkeeping+`
			ORDER BY c.relname, a.attnum`, bookkeeping),
		Indexes: list(`SELECT pg_get_indexdef(i.indexrelid) FROM pg_index i
			JOIN pg_class c ON c.oid = i.indrelid
			JOIN pg_namespace n ON n.oid = c.relnamespace
			WHERE n.nspname = $1 AND `+notBookkeeping+` ORDER BY 1`, bookkeeping),
		Constraints: list(`SELECT c.relname || ' ' || con.conname || ' ' || con.contype::text || ' ' || pg_get_constraintdef(con.oid)
			FROM pg_constraint con
			JOIN pg_class c ON c.oid = con.conrelid
			JOIN pg_namespace n ON n.oid = c.relnamespace
			WHERE n.nspname = $1 AND `+notBookkeeping+` ORDER BY 1`, bookkeeping),
		Triggers: list(`SELECT pg_get_triggerdef(tg.oid) || ' enabled=' || tg.tgenabled::text FROM pg_trigger tg
			JOIN pg_class c ON c.oid = tg.tgrelid
			JOIN pg_namespace n ON n.oid = c.relnamespace
			WHERE n.nspname = $1 AND NOT tg.tgisinternal AND `+notBookkeeping+` ORDER BY 1`, bookkeeping),
		Functions: list(`SELECT pg_get_functiondef(p.oid) FROM pg_proc p
			JOIN pg_namespace n ON n.oid = p.pronamespace
			WHERE n.nspname = $1 ORDER BY 1`),
	}
}

// migratorCatalog is the schema that idem's own Migrator makes.
func migratorCatalog(t *testing.T) catalog {
	t.Helper()
	pool, schema := pgtest.Setup(t)
	c := readCatalog(t, pool, schema)
	// Guard the comparison itself: it must see what 001 creates, or two empty
	// catalogs would compare equal.
	require.Contains(t, c.Relations, "inbox r")
	require.Contains(t, c.Relations, "effects r")
	require.NotEmpty(t, c.Indexes)
	require.NotEmpty(t, c.Constraints)
	require.Len(t, c.Triggers, 1, "commit_guard (004); 008 dropped 001's effects_notify")
	require.Len(t, c.Functions, 1, "idem_commit_guard (004); 008 dropped 001's idem_effects_notify")
	return c
}

// requireEmpty checks that schema holds nothing but the tool's bookkeeping.
func requireEmpty(t *testing.T, db interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}, schema string) {
	t.Helper()
	c := readCatalog(t, db, schema)
	for _, part := range [][]string{c.Relations, c.Columns, c.Indexes, c.Constraints, c.Triggers, c.Functions} {
		require.Empty(t, part, "everything reverted")
	}
}

// searchPathURL is the test database's URL with search_path set to schema, as a
// user's tool is pointed at the schema, and with the scheme replaced when given.
func searchPathURL(t *testing.T, scheme, schema string) string {
	t.Helper()
	u, err := url.Parse(pgtest.URL())
	require.NoError(t, err, "DATABASE_URL must be a URL for this test")
	if scheme != "" {
		u.Scheme = scheme
	}
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	return u.String()
}

// openDB opens a database/sql handle (pgx's stdlib driver) whose connections
// have search_path set to schema.
func openDB(t *testing.T, schema string) *sql.DB {
	t.Helper()
	cfg, err := pgx.ParseConfig(searchPathURL(t, "", schema))
	require.NoError(t, err)
	db := stdlib.OpenDB(*cfg)
	t.Cleanup(func() { _ = db.Close() })
	return db
}

func TestGooseAppliesTheMigrations(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	want := migratorCatalog(t)
	pool, schema := pgtest.Setup(t, pgtest.Options{NoMigrate: true})
	db := openDB(t, schema)

	p, err := goose.NewProvider(goose.DialectPostgres, db, migrate.GooseMigrationsFS())
	require.NoError(t, err)
	var sources []string
	for _, s := range p.ListSources() {
		sources = append(sources, fmt.Sprintf("%d %s", s.Version, path.Base(s.Path)))
	}
	var known []string
	for _, m := range migrate.Migrations() {
		known = append(known, fmt.Sprintf("%d %03d_%s.sql", m.Version, m.Version, m.Name))
	}
	require.Equal(t, known, sources, "goose sees every migration, with idem's version numbers")
	newest := int64(len(known))

	for round := range 2 { // up to the newest, down to zero, up again
		results, err := p.Up(ctx)
		require.NoError(t, err, "round %d", round)
		require.Len(t, results, len(known))
		v, err := p.GetDBVersion(ctx)
		require.NoError(t, err)
		require.Equal(t, newest, v)
		require.Equal(t, want, readCatalog(t, pool, schema), "goose makes the schema idem's Migrator makes (round %d)", round)
		if round == 1 {
			break
		}
		results, err = p.DownTo(ctx, 0)
		require.NoError(t, err)
		require.Len(t, results, len(known))
		v, err = p.GetDBVersion(ctx)
		require.NoError(t, err)
		require.Zero(t, v)
		requireEmpty(t, pool, schema)
	}
	// The tables landed in the schema of search_path, and nowhere else.
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM pg_tables WHERE tablename = 'goose_db_version' AND schemaname = $1`, schema))
}

// TestGooseCannotReadTheUpDownFiles is why the goose directory exists: goose takes
// the version from the file name and sees NNN_name.up.sql and NNN_name.down.sql
// as two migrations with one version.
func TestGooseCannotReadTheUpDownFiles(t *testing.T) {
	t.Parallel()
	_, schema := pgtest.Setup(t, pgtest.Options{NoMigrate: true})
	_, err := goose.NewProvider(goose.DialectPostgres, openDB(t, schema), migrate.MigrationsFS())
	require.ErrorContains(t, err, "duplicate migration version")
}

func TestGolangMigrateAppliesTheMigrations(t *testing.T) {
	t.Parallel()
	want := migratorCatalog(t)
	pool, schema := pgtest.Setup(t, pgtest.Options{NoMigrate: true})
	// As docs/migrations.md's command: the directory on disk (with the goose directory
	// inside it, which golang-migrate skips) and the pgx5 driver.
	m, err := gomigrate.New("file://"+srcDir, searchPathURL(t, "pgx5", schema))
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = m.Close() })
	newest := uint(len(migrate.Migrations()))

	for round := range 2 {
		require.NoError(t, m.Up(), "round %d", round)
		v, dirty, err := m.Version()
		require.NoError(t, err)
		require.False(t, dirty)
		require.Equal(t, newest, v)
		require.Equal(t, want, readCatalog(t, pool, schema), "golang-migrate makes the schema idem's Migrator makes (round %d)", round)
		if round == 1 {
			break
		}
		require.NoError(t, m.Down())
		_, _, err = m.Version()
		require.True(t, errors.Is(err, gomigrate.ErrNilVersion), "no version after down: %v", err)
		requireEmpty(t, pool, schema)
	}
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM pg_tables WHERE tablename = 'schema_migrations' AND schemaname = $1`, schema))
}

// TestGooseFilesHoldTheUpAndDownFiles checks the embedded goose files without the
// generator: each holds its version's up and down files unchanged, and only goose
// annotations besides. (TestGooseFilesAreCurrent checks the exact bytes.)
func TestGooseFilesHoldTheUpAndDownFiles(t *testing.T) {
	t.Parallel()
	fsys := migrate.GooseMigrationsFS()
	entries, err := fs.ReadDir(fsys, ".")
	require.NoError(t, err)
	ms := migrate.Migrations()
	require.Len(t, entries, len(ms), "one goose file per version; run "+Regenerate)
	for _, m := range ms {
		name := fmt.Sprintf("%03d_%s.sql", m.Version, m.Name)
		body, err := fs.ReadFile(fsys, name)
		require.NoError(t, err, "run "+Regenerate)
		_, rest, ok := strings.Cut(string(body), "\n-- +goose Up\n")
		require.True(t, ok, name)
		up, down, ok := strings.Cut(rest, "\n-- +goose Down\n")
		require.True(t, ok, name)
		strip := func(s string) string {
			var keep []string
			for _, l := range strings.Split(s, "\n") {
				if l != "-- +goose StatementBegin" && l != "-- +goose StatementEnd" {
					keep = append(keep, l)
				}
			}
			return strings.Join(keep, "\n")
		}
		require.Equal(t, strings.TrimRight(m.Up, "\n"), strings.TrimRight(strip(up), "\n"), "%s: up section; run "+Regenerate, name)
		require.Equal(t, strings.TrimRight(m.Down, "\n"), strings.TrimRight(strip(down), "\n"), "%s: down section; run "+Regenerate, name)
		require.Contains(t, m.Up+m.Down, ";")
	}
}
