package admin

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
)

// seedActivity writes n completed inbox keys and n done effects spread over the
// last 30 days (about n/720 an hour), n/100 failed keys and n/100 dead effects
// likewise, and n/1000 pending effects, then vacuums and analyzes.
func seedActivity(tb testing.TB, pool *pgxpool.Pool, n int) {
	tb.Helper()
	ctx := context.Background()
	for _, sql := range []string{
		`INSERT INTO inbox (consumer, key, fingerprint, state, completed_at, expires_at)
			SELECT 'c' || (g % 4), 'k' || g, '\x01', CASE WHEN g % 100 = 0 THEN 'failed' ELSE 'completed' END,
				now() - (g % 43200) * interval '1 minute', now() + interval '7 days'
			FROM generate_series(1, $1) g`,
		`INSERT INTO effects (kind, key, fingerprint, state, created_at, done_at, dead_at)
			SELECT 'mail', 'e' || g, '\x00', CASE WHEN g % 100 = 0 THEN 'dead' ELSE 'done' END,
				now() - (g % 43200) * interval '1 minute' - interval '2 seconds',
				CASE WHEN g % 100 = 0 THEN NULL ELSE now() - (g % 43200) * interval '1 minute' END,
				CASE WHEN g % 100 = 0 THEN now() - (g % 43200) * interval '1 minute' END
			FROM generate_series(1, $1) g`,
		`INSERT INTO effects (kind, key, fingerprint, state, created_at)
			SELECT 'mail', 'p' || g, '\x00', 'pending', now() - g * interval '1 second' FROM generate_series(1, $1 / 1000) g`,
	} {
		_, err := pool.Exec(ctx, sql, n)
		require.NoError(tb, err)
	}
	for _, sql := range []string{`VACUUM ANALYZE inbox`, `VACUUM ANALYZE effects`} {
		_, err := pool.Exec(ctx, sql)
		require.NoError(tb, err)
	}
}

// explainActivity is the plan of each of Activity's statements over the last day.
func explainActivity(tb testing.TB, pool *pgxpool.Pool, schema string) map[string]string {
	tb.Helper()
	q := newQueries(schema)
	start := time.Now().Add(-24 * time.Hour).Truncate(time.Minute)
	out := map[string]string{}
	for name, sql := range map[string]string{"inbox": q.activityInbox, "effects": q.activityEffects, "backlog": q.activityBacklog} {
		rows, err := pool.Query(context.Background(), `EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) `+sql, start)
		require.NoError(tb, err)
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(tb, err)
		out[name] = strings.Join(lines, "\n")
	}
	return out
}

// TestActivityReadsItsIndexes: on tables that hold a month of rows, each of
// Activity's statements reads a range of a partial index (inbox_settled_at_idx,
// effects_done_at_idx, effects_dead_at_idx; the backlog also effects_due_idx for
// the pending effects and effects_discarded_idx), never the whole table.
func TestActivityReadsItsIndexes(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 2})
	seedActivity(t, pool, 100_000)
	plans := explainActivity(t, pool, schema)
	for name, want := range map[string][]string{
		"inbox":   {"inbox_settled_at_idx"},
		"effects": {"effects_done_at_idx", "effects_dead_at_idx"},
		"backlog": {"effects_due_idx", "effects_done_at_idx", "effects_dead_at_idx", "effects_discarded_idx"},
	} {
		for _, idx := range want {
			require.Contains(t, plans[name], idx, "%s:\n%s", name, plans[name])
		}
		require.NotContains(t, plans[name], "Seq Scan", "%s:\n%s", name, plans[name])
	}
}

// BenchmarkActivity1M reads the per-minute activity of the last hour and of the
// last day over 1,000,000 inbox keys and 1,000,000 effects spread over 30 days.
// The plans are logged (go test -bench Activity1M -run ^$ -v ./admin).
func BenchmarkActivity1M(b *testing.B) {
	pool, schema := pgtest.Setup(b, pgtest.Options{MaxConns: 4})
	a, err := New(Config{Pool: pool, Schema: schema})
	require.NoError(b, err)
	start := time.Now()
	seedActivity(b, pool, 1_000_000)
	b.Logf("seeded in %s", time.Since(start).Round(time.Second))
	for name, plan := range explainActivity(b, pool, schema) {
		b.Logf("plan of the %s statement over a day:\n%s", name, plan)
	}
	ctx := context.Background()
	for _, w := range []struct {
		name   string
		window time.Duration
	}{{"hour", time.Hour}, {"day", 24 * time.Hour}} {
		b.Run(w.name, func(b *testing.B) {
			for b.Loop() {
				_, err := a.Activity(ctx, w.window)
				require.NoError(b, err)
			}
		})
	}
}
