package migrate_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/migrate"
)

// Up with a shard map migrates every shard, and running it again applies nothing;
// the one-database methods work through Shard.
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

	_, err = mg.List(ctx)
	require.ErrorIs(t, err, migrate.ErrOneShard)
	_, err = mg.Down(ctx)
	require.ErrorIs(t, err, migrate.ErrOneShard)
	require.Nil(t, mg.Shard("nope"))

	// A shard behind the others (a new shard) is brought up by the same call.
	_, err = mg.Shard("s2").Down(ctx)
	require.NoError(t, err)
	applied, err = mg.Up(ctx)
	require.NoError(t, err)
	require.Equal(t, allVersions()[len(allVersions())-1:], applied)
}
