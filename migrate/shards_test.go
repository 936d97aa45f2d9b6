package migrate_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/migrate"
)

// Up with a shard map migrates every shard, and running it again applies nothing;
// the other methods work over every shard too, and Shard is one shard's Migrator.
func TestUpOverShards(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	m := pgtest.Shards(t, pgtest.Options{NoMigrate: true})
	mg, err := migrate.New(migrate.Config{Shards: m})
	require.NoError(t, err)
	applied, err := mg.Up(ctx)
	require.NoError(t, err)
	require.Equal(t, allVersions(), applied)
	for _, s := range m.Shards {
		n := pgtest.ShardCount(t, s, `SELECT count(*) FROM `+s.Schema+`.idem_migrations`)
		require.Equal(t, len(allVersions()), n, "shard %s is migrated", s.Name)
		list, err := mg.Shard(s.Name).List(ctx)
		require.NoError(t, err)
		require.True(t, list[len(list)-1].Applied)
	}
	applied, err = mg.Up(ctx)
	require.NoError(t, err)
	require.Empty(t, applied, "a second Up applies nothing")

	// List, PlanDown, Revert and Down take the same path over the map: every
	// shard, in map order, each row naming its shard.
	list, err := mg.List(ctx)
	require.NoError(t, err)
	require.Len(t, list, len(m.Shards)*len(allVersions()))
	for i, s := range m.Shards {
		for _, mig := range list[i*len(allVersions()) : (i+1)*len(allVersions())] {
			require.Equal(t, s.Name, mig.Shard)
			require.True(t, mig.Applied, "shard %s migration %d", s.Name, mig.Version)
		}
	}
	newest := len(allVersions())
	plan, err := mg.PlanDown(ctx)
	require.NoError(t, err)
	require.Equal(t, newest, plan.Version)
	require.Nil(t, mg.Shard("nope"))

	// A shard behind the others (a new shard) is brought up by the same call.
	v, err := mg.Shard("s2").Down(ctx)
	require.NoError(t, err)
	require.Equal(t, newest, v)
	_, err = mg.PlanDown(ctx)
	require.Equal(t, "migrate_shards_differ", inbox.Code(err), "%v", err)
	_, err = mg.Revert(ctx, newest)
	require.ErrorContains(t, err, `shard "s2": schema `)
	require.Equal(t, newest-1, pgtest.ShardCount(t, m.Shards[1], `SELECT count(*) FROM `+m.Shards[1].Schema+`.idem_migrations`), "the failing shard reverted nothing")
	require.Equal(t, newest-1, pgtest.ShardCount(t, m.Shards[0], `SELECT count(*) FROM `+m.Shards[0].Schema+`.idem_migrations`), "the others reverted their step")
	applied, err = mg.Up(ctx)
	require.NoError(t, err)
	require.Equal(t, allVersions()[newest-1:], applied)

	v, err = mg.Down(ctx)
	require.NoError(t, err)
	require.Equal(t, newest, v, "Down reverts the newest step of every shard")
	for _, s := range m.Shards {
		require.Equal(t, newest-1, pgtest.ShardCount(t, s, `SELECT count(*) FROM `+s.Schema+`.idem_migrations`), "shard %s", s.Name)
	}
	_, err = mg.Up(ctx)
	require.NoError(t, err)
}
