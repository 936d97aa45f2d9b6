package effects

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
)

// TestClaimPlanNeedsNoStatistics: before the table was ever analyzed (a burst of
// effects into a table that was small), the claim still reads effects_due_idx in
// order for each kind and updates through the primary key: no sort of every due
// row, no bitmap or sequential scan, no hash join.
func TestClaimPlanNeedsNoStatistics(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 2})
	ctx := context.Background()
	_, err := pool.Exec(ctx, `INSERT INTO effects (tenant, kind, key, payload, fingerprint, next_attempt_at)
		SELECT CASE WHEN g % 3 = 0 THEN 't' || (g % 7) ELSE '' END,
			CASE WHEN g % 2 = 0 THEN 'mail' ELSE 'orphan' END,
			'k' || g, ''::bytea, sha256(''::bytea), now() - interval '1 hour' + g * interval '1 ms'
		FROM generate_series(1, 40000) g`)
	require.NoError(t, err)
	q := newQueries(schema, 200)
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for _, set := range claimSettings {
			if _, err := tx.Exec(ctx, set); err != nil {
				return err
			}
		}
		rows, err := tx.Query(ctx, "EXPLAIN (COSTS OFF) "+q.claim, []string{"mail", "sms"}, []int32{100, 100}, time.Minute)
		if err != nil {
			return err
		}
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return err
		}
		plan := strings.Join(lines, "\n")
		require.Contains(t, plan, "Index Scan using effects_due_idx", plan)
		require.Contains(t, plan, "Index Cond: ((kind = w.kind) AND (next_attempt_at <= now()))", plan)
		require.Contains(t, plan, "Index Scan using effects_pkey", plan)
		for _, bad := range []string{"Seq Scan", "Bitmap", "Sort", "Hash"} {
			require.NotContains(t, plan, bad, plan)
		}
		return nil
	})
	require.NoError(t, err)
}

// TestRecordPlanNeedsNoStatistics: both forms of the outcome write probe the primary
// key once per outcome, after ANALYZE has seen a large table, instead of hashing the
// whole table against the outcomes.
func TestRecordPlanNeedsNoStatistics(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 2})
	ctx := context.Background()
	_, err := pool.Exec(ctx, `INSERT INTO effects (kind, key, payload, fingerprint, fence)
		SELECT 'mail', 'k' || g, ''::bytea, sha256(''::bytea), 1 FROM generate_series(1, 30000) g`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `ANALYZE effects`)
	require.NoError(t, err)
	const n = 300
	tenants, kinds, keys, states := make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	fences, delays := make([]int64, n), make([]int64, n)
	inFlight, undo, errs := make([]bool, n), make([]int32, n), make([]*string, n)
	for i := range n {
		kinds[i], keys[i], states[i], fences[i] = "mail", "k"+strconv.Itoa(i*7), "done", 1
	}
	q := newQueries(schema, 100)
	for name, stmt := range map[string]string{"record": q.record, "recordAgain": q.recordAgain} {
		err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			for _, set := range recordSettings {
				if _, err := tx.Exec(ctx, set); err != nil {
					return err
				}
			}
			rows, err := tx.Query(ctx, "EXPLAIN (COSTS OFF) "+stmt, tenants, kinds, keys, fences, states, delays, inFlight, undo, errs)
			if err != nil {
				return err
			}
			lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
			if err != nil {
				return err
			}
			plan := strings.Join(lines, "\n")
			require.Contains(t, plan, "Index Scan using effects_pkey", name+"\n"+plan)
			for _, bad := range []string{"Seq Scan", "Bitmap", "Hash", "Merge"} {
				require.NotContains(t, plan, bad, name+"\n"+plan)
			}
			return nil
		})
		require.NoError(t, err)
	}
}
