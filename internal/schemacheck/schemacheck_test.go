package schemacheck_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/internal/schemacheck"
	"github.com/idemkit/idem/migrate"
)

// requireMissing checks err is the schema_missing error of schema, naming the
// command that fixes it and the text want.
func requireMissing(t *testing.T, err error, schema, want string) {
	t.Helper()
	require.ErrorIs(t, err, pgschema.ErrMissing)
	require.Equal(t, "schema_missing", errcode.Code(err))
	require.Contains(t, err.Error(), fmt.Sprintf("schema %q", schema))
	require.Contains(t, err.Error(), "idem migrate up --schema "+schema)
	require.Contains(t, err.Error(), want)
}

// The migrations are applied one at a time, as a migration tool of one's own
// applies them (the files as they are, into the schema of search_path): after each,
// the check reads exactly that level, and names the versions still missing.
func TestLevelFollowsEveryMigration(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.Setup(t, pgtest.Options{NoMigrate: true})
	ms := migrate.Migrations()
	require.Equal(t, len(ms), schemacheck.Versions(), "a new migration needs its probes in schemacheck")

	requireMissing(t, schemacheck.Start(false, discard, []schemacheck.Target{{DB: pool, Schema: schema}}), schema, "holds none of idem's tables")
	for i, mig := range ms {
		level, exists, err := schemacheck.Level(ctx, pool, schema)
		require.NoError(t, err)
		require.True(t, exists)
		require.Equal(t, i, level, "before %03d_%s", mig.Version, mig.Name)
		if i > 0 {
			want := fmt.Sprintf("is at migration %03d, and this build of idem needs %03d: %03d", i, len(ms), i+1)
			requireMissing(t, schemacheck.Start(false, discard, []schemacheck.Target{{DB: pool, Schema: schema}}), schema, want)
		}
		_, err = pool.Exec(ctx, mig.Up)
		require.NoError(t, err, "apply %03d_%s", mig.Version, mig.Name)
	}
	level, _, err := schemacheck.Level(ctx, pool, schema)
	require.NoError(t, err)
	require.Equal(t, len(ms), level)
	require.NoError(t, schemacheck.Start(false, discard, []schemacheck.Target{{DB: pool, Schema: schema}}))
}

func TestOlderLevelNamesEveryMissingVersion(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.Setup(t, pgtest.Options{NoMigrate: true})
	pgtest.ApplyMigrations(t, pool, 1, 5)
	err := schemacheck.Start(false, discard, []schemacheck.Target{{DB: pool, Schema: schema}})
	requireMissing(t, err, schema, "is at migration 005")
	require.Contains(t, err.Error(), "006, 007, 008 not applied")
	require.NoError(t, schemacheck.Start(true, discard, []schemacheck.Target{{DB: pool, Schema: schema}}), "skipped")
}

func TestSchemaThatDoesNotExist(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.Setup(t)
	schema := pgtest.NewSchemaName()
	requireMissing(t, schemacheck.Start(false, discard, []schemacheck.Target{{DB: pool, Schema: schema}}), schema, fmt.Sprintf("schema %q does not exist", schema))
}

// Over a shard map every shard is checked, and each that fails is named.
func TestEveryShardIsChecked(t *testing.T) {
	t.Parallel()
	good, goodSchema := pgtest.Setup(t)
	empty, emptySchema := pgtest.Setup(t, pgtest.Options{NoMigrate: true})
	empty2, emptySchema2 := pgtest.Setup(t, pgtest.Options{NoMigrate: true})
	targets := []schemacheck.Target{
		{Shard: "a", DB: good, Schema: goodSchema},
		{Shard: "b", DB: empty, Schema: emptySchema},
		{Shard: "c", DB: empty2, Schema: emptySchema2},
	}
	err := schemacheck.Start(false, discard, targets)
	requireMissing(t, err, emptySchema, `shard "b": `)
	requireMissing(t, err, emptySchema2, `shard "c": `)
	require.NotContains(t, err.Error(), `shard "a"`)
	require.NotContains(t, err.Error(), goodSchema)
	require.NoError(t, schemacheck.Start(false, discard, targets[:1]))
}

var discard = slog.New(slog.DiscardHandler)

// A database that does not answer is tried until Timeout, then named; a shard that
// does not answer is left out, and the others are still checked.
func TestUnreachableDatabase(t *testing.T) {
	t.Parallel()
	cfg, err := pgxpool.ParseConfig("postgres://postgres@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=1")
	require.NoError(t, err)
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	good, goodSchema := pgtest.Setup(t)
	empty, emptySchema := pgtest.Setup(t, pgtest.Options{NoMigrate: true})
	down := schemacheck.Target{Shard: "down", DB: pool, Schema: "idem"}
	require.NoError(t, schemacheck.Start(false, discard, []schemacheck.Target{{Shard: "up", DB: good, Schema: goodSchema}, down}))
	err = schemacheck.Start(false, discard, []schemacheck.Target{{Shard: "empty", DB: empty, Schema: emptySchema}, down})
	requireMissing(t, err, emptySchema, `shard "empty": `)
	require.NotContains(t, err.Error(), `shard "down"`)
	err = schemacheck.Start(false, discard, []schemacheck.Target{{DB: pool, Schema: "idem"}})
	require.ErrorIs(t, err, schemacheck.ErrUnavailable)
	require.Equal(t, "database_unavailable", errcode.Code(err))
	require.Contains(t, err.Error(), `schema "idem"`)
	require.False(t, errcode.IsPermanent(err))
}

// A role that may not read the catalog gets ErrCatalog, which names the opt-out;
// with the opt-out the check is skipped. The catalog is per database, so the test
// revokes it in a database of its own.
func TestRoleWithoutCatalog(t *testing.T) {
	t.Parallel()
	pgtest.Require(t)
	ctx := context.Background()
	admin, err := pgx.Connect(ctx, pgtest.URL())
	require.NoError(t, err)
	t.Cleanup(func() { _ = admin.Close(ctx) })
	name := pgtest.NewSchemaName()
	_, err = admin.Exec(ctx, `CREATE DATABASE `+name)
	require.NoError(t, err)
	_, err = admin.Exec(ctx, `CREATE ROLE `+name+` NOLOGIN`)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = admin.Exec(ctx, `DROP DATABASE IF EXISTS `+name+` WITH (FORCE)`)
		_, _ = admin.Exec(ctx, `DROP ROLE IF EXISTS `+name)
	})
	cfg := pgtest.PoolConfig(t, "idem", pgtest.Options{MaxConns: 2})
	cfg.ConnConfig.Database = name
	cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		_, err := c.Exec(ctx, `SET ROLE `+name)
		return err
	}
	own, err := pgx.ConnectConfig(ctx, cfg.ConnConfig.Copy())
	require.NoError(t, err)
	_, err = own.Exec(ctx, `REVOKE SELECT ON pg_catalog.pg_class, pg_catalog.pg_attribute, pg_catalog.pg_proc FROM PUBLIC`)
	require.NoError(t, err)
	require.NoError(t, own.Close(ctx))
	pool := pgtest.OpenPool(t, cfg)

	err = schemacheck.Start(false, discard, []schemacheck.Target{{DB: pool, Schema: "idem"}})
	require.ErrorIs(t, err, schemacheck.ErrCatalog)
	require.Equal(t, "schema_check_refused", errcode.Code(err))
	require.Contains(t, err.Error(), `schema "idem"`)
	require.Contains(t, err.Error(), "SkipSchemaCheck")
	require.NoError(t, schemacheck.Start(true, discard, []schemacheck.Target{{DB: pool, Schema: "idem"}}))
	require.False(t, errors.Is(err, pgschema.ErrMissing))
}
