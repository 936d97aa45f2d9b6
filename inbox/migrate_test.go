package inbox_test

import (
	"context"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/pgtest"
)

func TestMigratorUpTwiceIsNoop(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.Setup(t, pgtest.Options{NoMigrate: true})
	m, err := inbox.NewMigrator(pool, schema)
	require.NoError(t, err)
	applied, err := m.Up(ctx)
	require.NoError(t, err)
	require.Equal(t, allVersions(), applied)
	applied, err = m.Up(ctx)
	require.NoError(t, err)
	require.Empty(t, applied)

	list, err := m.List(ctx)
	require.NoError(t, err)
	require.Len(t, list, len(inbox.Migrations()))
	require.True(t, list[0].Applied)
	require.Equal(t, "core", list[0].Name)
}

func TestMigratorConcurrent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema := pgtest.NewSchemaName()
	t.Cleanup(func() { pgtest.DropSchema(t, schema) })
	pool := pgtest.NewPool(t, "public", 8)
	var wg sync.WaitGroup
	total := make([]int, 6)
	errs := make([]error, 6)
	for i := range 6 {
		wg.Go(func() {
			m, err := inbox.NewMigrator(pool, schema)
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
	require.Equal(t, len(inbox.Migrations()), sum, "each step applied once across all processes")
}

func TestMigratorDownAndUpAgain(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.Setup(t)
	m, err := inbox.NewMigrator(pool, schema)
	require.NoError(t, err)
	for want := len(inbox.Migrations()); want >= 1; want-- {
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
	m, err := inbox.NewMigrator(pool, schema)
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
	ms := inbox.Migrations()
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
	for _, m := range inbox.Migrations() {
		_, err := pool.Exec(ctx, m.Up)
		require.NoError(t, err)
	}
	require.Equal(t, 2, pgtest.Count(t, pool, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename IN ('inbox','effects')`, schema))
}
