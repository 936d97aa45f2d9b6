package admin

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
)

// TestBackfillProbeReadsTheIndex: the probe for failures without a group reads the
// group index from its NULL end, on a table whose statistics say that half the
// rows have a NULL group (the completed keys) and none of the failed ones do: a
// filter on "error_group IS NULL" is planned there as a pass over the whole table.
func TestBackfillProbeReadsTheIndex(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 2})
	ctx := context.Background()
	for _, sql := range []string{
		`INSERT INTO inbox (consumer, key, fingerprint, state, error, error_masked, error_group, completed_at, expires_at)
			SELECT 'c', 'f' || g, '\x01', 'failed', 'e', 'e', '\x0102030405060708', now(), now() + interval '1 day' FROM generate_series(1, 20000) g`,
		`INSERT INTO inbox (consumer, key, fingerprint, state, completed_at, expires_at)
			SELECT 'c', 'ok' || g, '\x01', 'completed', now(), now() + interval '1 day' FROM generate_series(1, 20000) g`,
		`INSERT INTO effects (kind, key, fingerprint, state, error_group, dead_at)
			SELECT 'm', 'd' || g, '\x00', 'dead', '\x0102030405060708', now() FROM generate_series(1, 20000) g`,
		`INSERT INTO effects (kind, key, fingerprint, state, done_at)
			SELECT 'm', 'ok' || g, '\x00', 'done', now() FROM generate_series(1, 20000) g`,
		`ANALYZE inbox`, `ANALYZE effects`,
	} {
		_, err := pool.Exec(ctx, sql)
		require.NoError(t, err)
	}
	q := newQueries(schema)
	for name, st := range map[string]struct{ sql, index string }{
		"inbox":   {q.ungroupedInbox, "inbox_failure_group_idx"},
		"effects": {q.ungroupedEffects, "effects_failure_group_idx"},
	} {
		// The generic plan, as a cached prepared statement runs it after five
		// executions.
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `SET LOCAL plan_cache_mode = force_generic_plan`); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `PREPARE probe_`+name+`(int) AS `+st.sql); err != nil {
				return err
			}
			rows, err := tx.Query(ctx, `EXPLAIN (COSTS OFF) EXECUTE probe_`+name+`(1)`)
			if err != nil {
				return err
			}
			lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
			if err != nil {
				return err
			}
			plan := strings.Join(lines, "\n")
			require.Contains(t, plan, "Index Scan Backward using "+st.index, "%s:\n%s", name, plan)
			require.NotContains(t, plan, "Seq Scan", "%s:\n%s", name, plan)
			require.NotContains(t, plan, "Sort", "%s:\n%s", name, plan)
			return nil
		})
		require.NoError(t, err)
	}
}
