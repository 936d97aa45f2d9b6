package janitor_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/janitor"
)

// One pass goes over every shard, each under its own advisory lock: a shard whose
// lock another janitor holds is skipped (ErrBusy, naming it) while the others are
// cleaned.
func TestJanitorPassesEveryShard(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	m := pgtest.Shards(t)
	for _, s := range m.Shards {
		seedJanitor(t, s.Pool, 5)
	}
	j, err := janitor.New(janitor.Config{Shards: m})
	require.NoError(t, err)

	// Another janitor's pass on s2: its lock is taken (the lock is per schema, on
	// the shard's own database).
	conn, err := m.Shards[1].Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	var locked bool
	require.NoError(t, conn.QueryRow(ctx, `SELECT pg_try_advisory_lock(hashtextextended($1, 0))`, "idem.janitor:"+m.Shards[1].Schema).Scan(&locked))
	require.True(t, locked)
	gone := func(i int) int {
		s := m.Shards[i]
		return pgtest.ShardCount(t, s, `SELECT count(*) FROM inbox WHERE key LIKE 'gone-%'`) +
			pgtest.ShardCount(t, s, `SELECT count(*) FROM effects WHERE key LIKE 'gone-%'`)
	}
	before := gone(1)
	require.Positive(t, before)

	st, err := j.RunOnce(ctx)
	require.ErrorIs(t, err, janitor.ErrBusy)
	require.ErrorContains(t, err, `shard "s2"`)
	require.Zero(t, gone(0), "s1 cleaned")
	require.Zero(t, gone(2), "s3 cleaned")
	require.Equal(t, before, gone(1), "s2, whose lock is held, untouched")
	require.EqualValues(t, 2*before, st.Deleted(), "the stats add up the shards")

	_, err = conn.Exec(ctx, `SELECT pg_advisory_unlock_all()`)
	require.NoError(t, err)
	st, err = j.RunOnce(ctx)
	require.NoError(t, err)
	require.EqualValues(t, before, st.Deleted())
	for i, s := range m.Shards {
		require.Zero(t, gone(i), "shard %s cleaned", s.Name)
		require.Positive(t, pgtest.ShardCount(t, s, `SELECT count(*) FROM inbox WHERE key LIKE 'keep-%'`))
	}
}
