package janitor_test

import (
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/janitor"
)

// One pass goes over every shard, each under its own advisory lock: a shard whose
// lock another janitor holds is skipped (ErrBusy, naming it) while the others are
// cleaned. Each shard's series carry its name: the shards share a schema name
// here, and their counts do not add up.
func TestJanitorPassesEveryShard(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	m := pgtest.Shards(t)
	for _, s := range m.Shards {
		seedJanitor(t, s.Pool, 5)
	}
	reg := prometheus.NewRegistry()
	j, err := janitor.New(janitor.Config{Shards: m, Registerer: reg})
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
	deletedBefore := map[string]int{}
	for i, s := range m.Shards {
		deletedBefore[s.Name] = gone(i)
	}
	// The shard's series: passes by result, rows deleted (both tables).
	shardSeries := func(s string) (ok, busy, deleted float64) {
		mfs, err := reg.Gather()
		require.NoError(t, err)
		for _, mf := range mfs {
			for _, one := range mf.GetMetric() {
				l := map[string]string{}
				for _, p := range one.GetLabel() {
					l[p.GetName()] = p.GetValue()
				}
				if l["shard"] != s {
					continue
				}
				v := one.GetCounter().GetValue()
				switch {
				case mf.GetName() == "idem_janitor_passes_total" && l["result"] == "ok":
					ok += v
				case mf.GetName() == "idem_janitor_passes_total" && l["result"] == "busy":
					busy += v
				case mf.GetName() == "idem_janitor_deleted_total":
					deleted += v
				}
			}
		}
		return ok, busy, deleted
	}

	st, err := j.RunOnce(ctx)
	require.ErrorIs(t, err, janitor.ErrBusy)
	require.ErrorContains(t, err, `shard "s2"`)
	require.Zero(t, gone(0), "s1 cleaned")
	require.Zero(t, gone(2), "s3 cleaned")
	require.Equal(t, before, gone(1), "s2, whose lock is held, untouched")
	require.EqualValues(t, 2*before, st.Deleted(), "the stats add up the shards")
	for _, s := range []string{"s1", "s3"} {
		ok, busy, deleted := shardSeries(s)
		require.Equal(t, []float64{1, 0, float64(deletedBefore[s])}, []float64{ok, busy, deleted}, "passes ok, busy and rows deleted on %s", s)
	}
	ok, busy, deleted := shardSeries("s2")
	require.Equal(t, []float64{0, 1, 0}, []float64{ok, busy, deleted}, "passes ok, busy and rows deleted on s2")

	_, err = conn.Exec(ctx, `SELECT pg_advisory_unlock_all()`)
	require.NoError(t, err)
	st, err = j.RunOnce(ctx)
	require.NoError(t, err)
	require.EqualValues(t, before, st.Deleted())
	ok, busy, deleted = shardSeries("s2")
	require.Equal(t, []float64{1, 1, float64(before)}, []float64{ok, busy, deleted}, "passes ok, busy and rows deleted on s2")
	for i, s := range m.Shards {
		require.Zero(t, gone(i), "shard %s cleaned", s.Name)
		require.Positive(t, pgtest.ShardCount(t, s, `SELECT count(*) FROM inbox WHERE key LIKE 'keep-%'`))
	}
}
