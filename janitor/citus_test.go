package janitor_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/janitor"
)

// On Citus, a pass deletes the expired inbox keys and the old done and discarded
// effects of every tenant, on every worker, in batches of BatchSize, and nothing
// else: Citus refuses the plain Postgres delete (FOR UPDATE across shards), so
// the janitor deletes by primary key there.
func TestCitusJanitorDeletesOnlyWhatRetentionLetsGo(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.CitusSetup(t, pgtest.Options{MaxConns: 4})
	ctx := context.Background()
	for _, q := range []string{
		`INSERT INTO inbox (consumer, tenant, key, fingerprint, state, completed_at, expires_at)
			SELECT 'c', 't' || i % 5, 'gone-' || i, '\x00', CASE WHEN i % 2 = 0 THEN 'completed' ELSE 'failed' END,
				now() - interval '8 days', now() - interval '1 day' - i * interval '1 s'
			FROM generate_series(1, 40) i`,
		`INSERT INTO inbox (consumer, tenant, key, fingerprint, state, completed_at, expires_at)
			SELECT 'c', 't' || i % 5, 'keep-fresh-' || i, '\x00', 'completed', now(), now() + interval '7 days'
			FROM generate_series(1, 10) i`,
		`INSERT INTO inbox (consumer, tenant, key, fingerprint, state, lease_until, fence, expires_at)
			SELECT 'c', 't' || i % 5, 'keep-processing-' || i, '\x00', 'processing', now() - interval '9 days', 1, now() - interval '8 days'
			FROM generate_series(1, 10) i`,
		`INSERT INTO effects (tenant, kind, key, fingerprint, state, done_at)
			SELECT 't' || i % 5, 'email', 'gone-' || i, '\x00', CASE WHEN i % 3 = 0 THEN 'discarded' ELSE 'done' END, now() - interval '8 days'
			FROM generate_series(1, 30) i`,
		`INSERT INTO effects (tenant, kind, key, fingerprint, state, done_at)
			SELECT 't' || i % 5, 'email', 'keep-done-fresh-' || i, '\x00', 'done', now() - interval '1 day'
			FROM generate_series(1, 10) i`,
		`INSERT INTO effects (tenant, kind, key, fingerprint, state, done_at)
			SELECT 't' || i % 5, 'email', 'keep-dead-' || i, '\x00', 'dead', now() - interval '30 days'
			FROM generate_series(1, 10) i`,
		`INSERT INTO effects (tenant, kind, key, fingerprint, state)
			SELECT 't' || i % 5, 'email', 'keep-pending-' || i, '\x00', 'pending'
			FROM generate_series(1, 10) i`,
	} {
		_, err := pool.Exec(ctx, q)
		require.NoError(t, err)
	}
	var steps []janitor.Stats
	j := newJanitor(t, pool, schema, func(c *janitor.Config) {
		c.BatchSize = 7
		c.OnBatch = func(s janitor.Stats) { steps = append(steps, s) }
	})
	st, err := j.RunOnce(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 40, st.InboxDeleted)
	require.EqualValues(t, 30, st.EffectsDeleted)
	require.Zero(t, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE key LIKE 'gone-%'`))
	require.Zero(t, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE key LIKE 'gone-%'`))
	require.Equal(t, 20, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE key LIKE 'keep-%'`))
	require.Equal(t, 30, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE key LIKE 'keep-%'`))
	var prev janitor.Stats
	for _, s := range steps {
		require.LessOrEqual(t, s.InboxDeleted-prev.InboxDeleted, int64(7))
		require.LessOrEqual(t, s.EffectsDeleted-prev.EffectsDeleted, int64(14)) // done and discarded, 7 each
		prev = s
	}
	st, err = j.RunOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, st.Deleted())
}
