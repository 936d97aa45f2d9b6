package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"testing"

	gomigrate "github.com/golang-migrate/migrate/v4"
	_ "github.com/golang-migrate/migrate/v4/database/pgx/v5" // the pgx5:// driver
	"github.com/golang-migrate/migrate/v4/source/iofs"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/migrate"
)

// withSearchPath is the test database's URL with search_path set to schema, and
// the scheme replaced when given: a user's tool pointed at the schema.
func withSearchPath(t *testing.T, scheme, schema string) string {
	t.Helper()
	u, err := url.Parse(pgtest.URL())
	require.NoError(t, err)
	if scheme != "" {
		u.Scheme = scheme
	}
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	return u.String()
}

// applyWithGoose applies idem's goose files to schema with goose, as
// docs/migrations.md says.
func applyWithGoose(t *testing.T, schema string) {
	t.Helper()
	cfg, err := pgx.ParseConfig(withSearchPath(t, "", schema))
	require.NoError(t, err)
	db := stdlib.OpenDB(*cfg)
	t.Cleanup(func() { _ = db.Close() })
	p, err := goose.NewProvider(goose.DialectPostgres, db, migrate.GooseMigrationsFS())
	require.NoError(t, err)
	_, err = p.Up(context.Background())
	require.NoError(t, err)
}

// applyWithGolangMigrate applies idem's files to schema with golang-migrate.
func applyWithGolangMigrate(t *testing.T, schema string) {
	t.Helper()
	src, err := iofs.New(migrate.MigrationsFS(), ".")
	require.NoError(t, err)
	m, err := gomigrate.NewWithSourceInstance("iofs", src, withSearchPath(t, "pgx5", schema))
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = m.Close() })
	require.NoError(t, m.Up())
}

// On a schema that goose or golang-migrate manages, idem's migrator (List and Up)
// and the CLI (migrate list, migrate up) say which tool manages it, at which
// version, and what to run instead, and change nothing.
func TestMigratorOnASchemaAnotherToolManages(t *testing.T) {
	t.Parallel()
	newest := len(migrate.Migrations())
	for _, tc := range []struct {
		tool, table, instead string
		apply                func(*testing.T, string)
	}{
		{"goose", "goose_db_version", `goose -dir "$IDEM/migrate/migrations/goose" postgres`, applyWithGoose},
		{"golang-migrate", "schema_migrations", `migrate -path "$IDEM/migrate/migrations"`, applyWithGolangMigrate},
	} {
		t.Run(tc.tool, func(t *testing.T) {
			b := setup(t, pgtest.Options{NoMigrate: true})
			tc.apply(t, b.schema)
			want := []string{
				fmt.Sprintf("schema %s is managed by %s: its table %s.%s is at version %d", b.schema, tc.tool, b.schema, tc.table, newest),
				tc.instead, "search_path=" + b.schema,
			}
			requireManaged := func(err error) {
				t.Helper()
				require.ErrorIs(t, err, migrate.ErrManagedElsewhere)
				require.Equal(t, "schema_managed_elsewhere", errCode(err))
				for _, w := range want {
					require.Contains(t, err.Error(), w)
				}
			}
			m, err := migrate.New(migrate.Config{Pool: b.pool, Schema: b.schema})
			require.NoError(t, err)
			ctx := context.Background()
			_, err = m.List(ctx)
			requireManaged(err)
			applied, err := m.Up(ctx)
			requireManaged(err)
			require.Empty(t, applied)
			require.Equal(t, 0, pgtest.Count(t, b.pool, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'idem_migrations'`, b.schema),
				"Up changed nothing")

			for _, action := range []string{"list", "up"} {
				r := b.idem("migrate", action)
				require.Equal(t, exitFailure, r.code, "%s\n%s", action, r.stderr)
				require.Empty(t, r.stdout, action)
				for _, w := range want {
					require.Contains(t, r.stderr, w, action)
				}
				var out errorJSON
				r = b.idem("migrate", action, "--json")
				require.Equal(t, exitFailure, r.code)
				require.NoError(t, json.Unmarshal([]byte(r.stderr), &out), r.stderr)
				require.Equal(t, "schema_managed_elsewhere", out.Code)
			}
		})
	}
}

// errCode is the code of err's coded error.
func errCode(err error) string {
	var c interface{ Code() string }
	if errors.As(err, &c) {
		return c.Code()
	}
	return ""
}

// goose's table may live outside idem's schema (a goose run whose search_path put
// it in another schema first): the migrator finds it through its own search_path.
func TestMigratorFindsAToolTableInSearchPath(t *testing.T) {
	b := setup(t, pgtest.Options{NoMigrate: true})
	applyWithGoose(t, b.schema)
	_, other := pgtest.Setup(t, pgtest.Options{NoMigrate: true})
	ctx := context.Background()
	_, err := b.pool.Exec(ctx, `ALTER TABLE `+b.schema+`.goose_db_version SET SCHEMA `+other)
	require.NoError(t, err)
	pool := pgtest.NewPool(t, other, 2) // search_path: the schema that has goose's table
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: b.schema})
	require.NoError(t, err)
	_, err = m.Up(ctx)
	require.ErrorIs(t, err, migrate.ErrManagedElsewhere)
	require.Contains(t, err.Error(), fmt.Sprintf("schema %s is managed by goose: its table %s.goose_db_version is at version %d",
		b.schema, other, len(migrate.Migrations())))

	// With no tool's table anywhere, the migrator still refuses, and says why.
	_, err = b.pool.Exec(ctx, `DROP TABLE `+other+`.goose_db_version`)
	require.NoError(t, err)
	_, err = m.Up(ctx)
	require.ErrorIs(t, err, migrate.ErrManagedElsewhere)
	require.Contains(t, err.Error(), "no goose_db_version or schema_migrations table is found")
	require.Equal(t, 0, pgtest.Count(t, b.pool, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'idem_migrations'`, b.schema))
}
