package admin_test

import (
	"context"
	"encoding/hex"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/internal/failgroup"
	"github.com/idemkit/idem/internal/pgtest"
)

// seedFailed writes n failed inbox keys in 100 groups (of 4 consumers) and n/5
// dead effects in 20 groups, beside n completed keys and n/5 done effects that the
// groups must not read, then analyzes and vacuums (the visibility map lets the
// aggregate read the index alone).
func seedFailed(tb testing.TB, pool *pgxpool.Pool, n int) {
	tb.Helper()
	ctx := context.Background()
	masked := `'order <n> failed: code ' || (g % 100)`
	for _, sql := range []string{
		`INSERT INTO inbox (consumer, key, fingerprint, state, error_code, error, error_masked, error_group, completed_at, expires_at)
			SELECT 'c' || (g % 4), 'f' || g, '\x01', 'failed', 'bad', 'order ' || g || ' failed: code ' || (g % 100), ` + masked + `,
				` + failgroup.GroupSQL("'c' || (g % 4)", "''", "'bad'", masked) + `,
				now() - (g % 3600) * interval '1 second', now() + interval '7 days'
			FROM generate_series(1, $1) g`,
		`INSERT INTO inbox (consumer, key, fingerprint, state, completed_at, expires_at)
			SELECT 'c' || (g % 4), 'ok' || g, '\x01', 'completed', now(), now() + interval '7 days' FROM generate_series(1, $1) g`,
		`INSERT INTO effects (kind, key, fingerprint, state, attempts, last_error, error_masked, error_group, dead_at)
			SELECT 'mail', 'd' || g, '\x00', 'dead', 1 + g % 5, 'rejected ' || g, 'rejected <n> ' || (g % 20),
				` + failgroup.GroupSQL("'mail'", "''", "NULL", "'rejected <n> ' || (g % 20)") + `, now() - (g % 3600) * interval '1 second'
			FROM generate_series(1, $1 / 5) g`,
		`INSERT INTO effects (kind, key, fingerprint, state, done_at)
			SELECT 'mail', 'ok' || g, '\x00', 'done', now() FROM generate_series(1, $1 / 5) g`,
	} {
		_, err := pool.Exec(ctx, sql, n)
		require.NoError(tb, err)
	}
	for _, sql := range []string{`VACUUM ANALYZE inbox`, `VACUUM ANALYZE effects`} {
		_, err := pool.Exec(ctx, sql)
		require.NoError(tb, err)
	}
}

// explain is the plan Postgres runs sql with, with row counts.
func explain(tb testing.TB, pool *pgxpool.Pool, sql string, args ...any) string {
	tb.Helper()
	rows, err := pool.Query(context.Background(), `EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) `+sql, args...)
	require.NoError(tb, err)
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(tb, err)
	return strings.Join(lines, "\n")
}

// listAgg is the inbox half of the groups list's aggregate (failure_queries.go),
// whose plan decides what a list costs.
const listAgg = `SELECT i.error_group, i.consumer, i.tenant, count(*), min(i.completed_at), max(i.completed_at)
	FROM inbox i WHERE i.state = 'failed' AND i.error_group IS NOT NULL
	GROUP BY i.error_group, i.consumer, i.tenant`

// TestGroupsUseTheGroupIndex: on tables with many more settled rows than failed
// ones, the groups' aggregate reads inbox_failure_group_idx (an index-only scan
// into a GroupAggregate once vacuumed: BenchmarkListGroups1M logs it), never the
// whole table, and the rows of one group are one range of it.
func TestGroupsUseTheGroupIndex(t *testing.T) {
	a, b := setup(t)
	seedFailed(t, b.pool, 20000)
	// As in production, far more settled rows than failed ones.
	b.exec(t, `INSERT INTO inbox (consumer, key, fingerprint, state, completed_at, expires_at)
		SELECT 'c' || (g % 4), 'more' || g, '\x01', 'completed', now(), now() + interval '7 days' FROM generate_series(1, 100000) g`)
	b.exec(t, `INSERT INTO effects (kind, key, fingerprint, state, done_at)
		SELECT 'mail', 'more' || g, '\x00', 'done', now() FROM generate_series(1, 60000) g`)
	b.exec(t, `VACUUM ANALYZE inbox`)
	b.exec(t, `VACUUM ANALYZE effects`)
	// The index, never the table: an index-only scan once the visibility map is
	// set, else (while other tests' snapshots hold VACUUM back) a bitmap scan of
	// the same index and its failed rows alone.
	plan := explain(t, b.pool, listAgg)
	require.Contains(t, plan, "inbox_failure_group_idx", plan)
	require.NotContains(t, plan, "Seq Scan", plan)

	// The whole list with a code filter: the code is read from one row of each
	// group's range, never by a pass over the table.
	plan = explain(t, b.pool, admin.ListGroupsSQL(b.schema), true, true, "", "", nil, nil, nil,
		false, false, int64(-1), "", 51, admin.ListSamples, "bad")
	require.Contains(t, plan, "inbox_failure_group_idx", plan)
	require.Contains(t, plan, "effects_failure_group_idx", plan)
	require.NotContains(t, plan, "Seq Scan", plan)

	g := groupsOf(t, a, admin.GroupFilter{Source: admin.SourceInbox})[0]
	require.Equal(t, int64(200), g.Count) // 20000 rows, 100 groups
	bad := groupsOf(t, a, admin.GroupFilter{Code: "bad"})
	require.Len(t, bad, 100, "the inbox groups: the effects have no code")
	for _, g := range bad {
		require.Equal(t, admin.SourceInbox, g.Source)
	}
	// The samples of a merged page's groups (a shard map's list): one backward
	// range of each group's index, never the table.
	var hashes [][]byte
	var sources, places, tenants []string
	for _, g := range groupsOf(t, a, admin.GroupFilter{})[:5] {
		h, err := hex.DecodeString(g.ID[2:])
		require.NoError(t, err)
		hashes, sources, places, tenants = append(hashes, h), append(sources, g.Source), append(places, g.Place()), append(tenants, g.Tenant)
	}
	plan = explain(t, b.pool, admin.GroupSamplesSQL(b.schema), sources, hashes, places, tenants, nil, nil, admin.ListSamples)
	require.Contains(t, plan, "inbox_failure_group_idx", plan)
	require.Contains(t, plan, "effects_failure_group_idx", plan)
	require.NotContains(t, plan, "Seq Scan", plan)

	hash := g.ID[2:]
	plan = explain(t, b.pool, `SELECT key FROM inbox WHERE error_group = decode($1, 'hex') AND state = 'failed' AND completed_at <= now()`, hash)
	require.Contains(t, plan, "inbox_failure_group_idx", plan)
	require.NotContains(t, plan, "Seq Scan", plan)

	plan = explain(t, b.pool, `SELECT e.error_group, e.kind, e.tenant, count(*) FROM effects e
		WHERE e.state = 'dead' AND e.error_group IS NOT NULL GROUP BY e.error_group, e.kind, e.tenant`)
	require.Contains(t, plan, "effects_failure_group_idx", plan)
	require.NotContains(t, plan, "Seq Scan", plan)
}

// BenchmarkListGroups1M lists the failure groups (first page, by count; a show;
// a release's dry run) over 1,000,000 failed inbox keys and 200,000 dead effects,
// beside 1,000,000 completed keys and 200,000 done effects. The plan of the
// aggregate is logged (go test -bench ListGroups1M -run ^$ -v ./admin).
func BenchmarkListGroups1M(b *testing.B) {
	pool, schema := pgtest.Setup(b, pgtest.Options{MaxConns: 4})
	a, err := admin.New(admin.Config{Pool: pool, Schema: schema})
	require.NoError(b, err)
	start := time.Now()
	seedFailed(b, pool, 1_000_000)
	b.Logf("seeded in %s", time.Since(start).Round(time.Second))
	b.Logf("plan of the inbox groups' aggregate:\n%s", explain(b, pool, listAgg))
	ctx := context.Background()
	first, err := a.ListGroups(ctx, admin.GroupFilter{Source: admin.SourceInbox}, admin.Page{Limit: 50})
	require.NoError(b, err)
	require.Len(b, first.Rows, 50)
	g := first.Rows[0]

	b.Run("list", func(b *testing.B) {
		for b.Loop() {
			_, err := a.ListGroups(ctx, admin.GroupFilter{}, admin.Page{Limit: 50})
			require.NoError(b, err)
		}
	})
	b.Run("list-one-consumer-recent", func(b *testing.B) {
		for b.Loop() {
			_, err := a.ListGroups(ctx, admin.GroupFilter{Consumer: "c1", Order: admin.ByRecent}, admin.Page{Limit: 50})
			require.NoError(b, err)
		}
	})
	b.Run("list-one-code", func(b *testing.B) {
		for b.Loop() {
			_, err := a.ListGroups(ctx, admin.GroupFilter{Code: g.Code}, admin.Page{Limit: 50})
			require.NoError(b, err)
		}
	})
	b.Run("show", func(b *testing.B) {
		for b.Loop() {
			_, err := a.Group(ctx, g.ID, admin.TimeRange{})
			require.NoError(b, err)
		}
	})
	b.Run("release-dry-run", func(b *testing.B) {
		for b.Loop() {
			_, err := a.ReleaseGroup(ctx, admin.GroupAction{ID: g.ID, Through: g.LastSeen, DryRun: true})
			require.NoError(b, err)
		}
	})
}
