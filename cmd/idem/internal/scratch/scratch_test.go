package scratch_test

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/cmd/idem/internal/scratch"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/migrate"
)

func setup(t *testing.T) (*pgxpool.Pool, string) {
	t.Helper()
	t.Parallel()
	pgtest.Require(t)
	name := pgtest.NewSchemaName()
	t.Cleanup(func() { pgtest.DropSchema(t, name) })
	return pgtest.NewPool(t, "public", 2), name
}

func claim(t *testing.T, name string) (*scratch.Schema, error) {
	t.Helper()
	s, err := scratch.Claim(context.Background(), pgtest.URL(), name, "scratch test")
	if err == nil {
		t.Cleanup(s.Release)
	}
	return s, err
}

// A new name is created and marked; a marked schema is dropped and made again,
// so what an earlier run left is gone.
func TestClaimCreatesMarksAndResets(t *testing.T) {
	pool, name := setup(t)
	ctx := context.Background()
	s, err := claim(t, name)
	require.NoError(t, err)
	require.False(t, s.Reset)
	ok, err := scratch.IsScratch(ctx, pool, name)
	require.NoError(t, err)
	require.True(t, ok)
	// What a demo leaves: idem's tables (indexes, a trigger and its function),
	// and a ledger with a sequence and a view of its own.
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: name})
	require.NoError(t, err)
	_, err = m.Up(ctx)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `CREATE TABLE `+name+`.ledger (id bigserial PRIMARY KEY, k text REFERENCES `+name+`.ledger (k2), k2 text UNIQUE);
		CREATE VIEW `+name+`.ledger_v AS SELECT * FROM `+name+`.ledger`)
	require.NoError(t, err)
	s.Release()

	s, err = claim(t, name)
	require.NoError(t, err)
	require.True(t, s.Reset)
	require.Zero(t, pgtest.Count(t, pool, `SELECT count(*) FROM pg_tables WHERE schemaname = $1`, name))
}

// A schema that Claim did not make is refused, and its data is untouched.
func TestClaimRefusesASchemaItDidNotMake(t *testing.T) {
	pool, name := setup(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE SCHEMA `+name+`; CREATE TABLE `+name+`.orders (id int); INSERT INTO `+name+`.orders VALUES (1), (2)`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `COMMENT ON SCHEMA `+name+` IS 'the shop''s orders'`)
	require.NoError(t, err)

	_, err = claim(t, name)
	var re *scratch.RefusedError
	require.ErrorAs(t, err, &re)
	require.Contains(t, err.Error(), "has no idem scratch marker")
	require.Equal(t, 2, pgtest.Count(t, pool, `SELECT count(*) FROM `+name+`.orders`))
	ok, err := scratch.IsScratch(ctx, pool, name)
	require.NoError(t, err)
	require.False(t, ok)
}

func TestClaimRefusesReservedSchemas(t *testing.T) {
	t.Parallel()
	pgtest.Require(t)
	for _, name := range []string{"public", "idem", "information_schema", "pg_catalog"} {
		_, err := scratch.Claim(context.Background(), pgtest.URL(), name, "scratch test")
		var re *scratch.RefusedError
		require.ErrorAs(t, err, &re, name)
	}
}

// A marked schema that a user's objects elsewhere depend on is refused: DROP
// CASCADE would take the user's view and foreign key with it.
func TestClaimRefusesWhenObjectsOutsideDependOnIt(t *testing.T) {
	pool, name := setup(t)
	ctx := context.Background()
	s, err := claim(t, name)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `CREATE TABLE `+name+`.ledger (id int PRIMARY KEY)`)
	require.NoError(t, err)
	s.Release()
	user := pgtest.NewSchemaName()
	t.Cleanup(func() { pgtest.DropSchema(t, user) })
	_, err = pool.Exec(ctx, `CREATE SCHEMA `+user+`; CREATE VIEW `+user+`.report AS SELECT count(*) FROM `+name+`.ledger`)
	require.NoError(t, err)

	_, err = claim(t, name)
	var re *scratch.RefusedError
	require.ErrorAs(t, err, &re)
	require.Contains(t, err.Error(), user+".report")
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM pg_views WHERE schemaname = $1`, user))
}

// Runs that claim one schema at once: exactly one gets it, the others get
// ErrInUse and change nothing; after Release the next one gets it.
func TestClaimIsExclusive(t *testing.T) {
	pool, name := setup(t)
	ctx := context.Background()
	const runs = 4
	var wg sync.WaitGroup
	got := make([]*scratch.Schema, runs)
	errs := make([]error, runs)
	for i := range runs {
		wg.Go(func() { got[i], errs[i] = scratch.Claim(ctx, pgtest.URL(), name, "scratch test") })
	}
	wg.Wait()
	var winner *scratch.Schema
	for i := range runs {
		if errs[i] == nil {
			require.Nil(t, winner, "two runs claimed one schema")
			winner = got[i]
			continue
		}
		require.True(t, errors.Is(errs[i], scratch.ErrInUse), errs[i])
	}
	require.NotNil(t, winner)
	held, err := scratch.InUse(ctx, pool, name)
	require.NoError(t, err)
	require.True(t, held)

	winner.Release()
	held, err = scratch.InUse(ctx, pool, name)
	require.NoError(t, err)
	require.False(t, held)
	_, err = claim(t, name)
	require.NoError(t, err)
}
