package migrate_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/migrate"
)

// distribution is how Citus holds each table of schema: 'h' (hash-distributed),
// 'n' (reference), or absent (a plain table of the coordinator), with its
// colocation group and distribution column.
func distribution(t *testing.T, q *pgxpool.Pool, schema string) map[string]string {
	t.Helper()
	rows, err := q.Query(context.Background(), `SELECT c.relname, p.partmethod::text || ' ' || coalesce(column_to_column_name(p.logicalrelid, p.partkey), '-')
		|| ' ' || CASE WHEN p.colocationid = (SELECT colocationid FROM pg_dist_partition WHERE logicalrelid = to_regclass($1 || '.inbox')) THEN 'with-inbox' ELSE 'alone' END
		FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		JOIN pg_dist_partition p ON p.logicalrelid = c.oid
		WHERE n.nspname = $1`, schema)
	require.NoError(t, err)
	out := map[string]string{}
	for rows.Next() {
		var name, how string
		require.NoError(t, rows.Scan(&name, &how))
		out[name] = how
	}
	require.NoError(t, rows.Err())
	return out
}

// Up in Citus mode distributes inbox and effects by tenant, colocated, makes
// failure_actions a reference table and leaves commit_guard and idem_migrations
// on the coordinator; a second Up changes nothing.
func TestUpCitusDistributesByTenant(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.Citus(t, pgtest.Options{MaxConns: 2})
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: schema, Citus: true})
	require.NoError(t, err)
	release := pgtest.CitusDDL(t)
	applied, err := m.Up(ctx)
	release()
	require.NoError(t, err)
	require.Equal(t, allVersions(), applied)
	want := map[string]string{
		"inbox":           "h tenant with-inbox",
		"effects":         "h tenant with-inbox",
		"failure_actions": "n - alone",
	}
	require.Equal(t, want, distribution(t, pool, schema))
	applied, err = m.Up(ctx)
	require.NoError(t, err)
	require.Empty(t, applied)
	require.Equal(t, want, distribution(t, pool, schema))
}

// A schema migrated without Citus mode on the coordinator becomes a Citus one by
// Up in Citus mode, rows and all; after that, Up without the flag keeps it so.
func TestUpCitusConvertsAPlainSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.Citus(t, pgtest.Options{MaxConns: 2})
	plain, err := migrate.New(migrate.Config{Pool: pool, Schema: schema})
	require.NoError(t, err)
	_, err = plain.Up(ctx)
	require.NoError(t, err)
	require.Empty(t, distribution(t, pool, schema))
	_, err = pool.Exec(ctx, `INSERT INTO inbox (consumer, tenant, key, fingerprint, state, expires_at)
		VALUES ('c', 'a', 'k1', '\x01', 'completed', now() + interval '1 day'), ('c', 'b', 'k1', '\x02', 'completed', now() + interval '1 day')`)
	require.NoError(t, err)

	citus, err := migrate.New(migrate.Config{Pool: pool, Schema: schema, Citus: true})
	require.NoError(t, err)
	release := pgtest.CitusDDL(t)
	applied, err := citus.Up(ctx)
	release()
	require.NoError(t, err)
	require.Empty(t, applied)
	require.Equal(t, "h tenant with-inbox", distribution(t, pool, schema)["inbox"])
	require.Equal(t, 2, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE consumer = 'c' AND key = 'k1'`))
	_, err = plain.Up(ctx)
	require.NoError(t, err)
	require.Equal(t, "h tenant with-inbox", distribution(t, pool, schema)["effects"])
}

// Citus mode on a database without the citus extension is refused with its code,
// and nothing is applied.
func TestUpCitusRefusesPlainPostgres(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.Setup(t, pgtest.Options{NoMigrate: true, MaxConns: 2})
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: schema, Citus: true})
	require.NoError(t, err)
	_, err = m.Up(ctx)
	require.ErrorIs(t, err, migrate.ErrNoCitus)
	require.Equal(t, "no_citus", errcode.Code(err))
	var pgErr interface{ SQLState() string }
	require.False(t, errors.As(err, &pgErr))
	list, err := m.List(ctx)
	require.NoError(t, err)
	require.False(t, list[0].Applied)
}
