package inboxdb_test

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/pgtest"
)

// TestClaimBatchPlanNeedsNoStatistics: the plan that a prepared ClaimBatch (or
// GetBatch, and their one-tenant forms) caches probes the primary key once per key, on a new inbox that was
// never analyzed as on a large analyzed one. Flattened into a join, the probe was
// planned on a new table as a hash join over a sequential scan of the whole inbox,
// and pgx's prepared statement kept that plan while the table grew: a claim of 85
// keys took 9 ms at 50,000 rows.
func TestClaimBatchPlanNeedsNoStatistics(t *testing.T) {
	t.Parallel()
	for _, table := range []string{"new", "analyzed"} {
		t.Run(table, func(t *testing.T) {
			t.Parallel()
			pool, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 2})
			ctx := context.Background()
			if table == "analyzed" {
				_, err := pool.Exec(ctx, `INSERT INTO inbox (consumer, key, fingerprint, state, completed_at, expires_at)
					SELECT 'c', 'k' || g, '\x00', 'completed', now(), now() + interval '1 day' FROM generate_series(1, 50000) g;
					ANALYZE inbox`)
				require.NoError(t, err)
			}
			q := inboxdb.New(schema)
			claimSQL, getSQL := q.ClaimBatch, q.GetBatch
			stmts := map[string]struct{ sql, types, args string }{
				"claimBatch": {claimSQL, "text[], text[], text[], bytea[], bool[], text[], text[], bigint[], text[]",
					`'{c,c}', '{"",""}', '{k1,k2}', '{"\\x00","\\x00"}', NULL, NULL, NULL, '{1,1}', NULL`},
				"getBatch": {getSQL, "text[], text[], text[]", `'{c,c}', '{"",""}', '{k1,k2}'`},
				"claimBatchOneTenant": {q.ClaimBatchOneTenant, "text[], text[], text[], bytea[], bool[], text[], text[], bigint[], text[], text",
					`'{c,c}', '{"",""}', '{k1,k2}', '{"\\x00","\\x00"}', NULL, NULL, NULL, '{1,1}', NULL, ''`},
				"getBatchOneTenant": {q.GetBatchOneTenant, "text[], text[], text[], text", `'{c,c}', '{"",""}', '{k1,k2}', ''`},
			}
			for name, st := range stmts {
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					if _, err := tx.Exec(ctx, `SET LOCAL plan_cache_mode = force_generic_plan`); err != nil {
						return err
					}
					if _, err := tx.Exec(ctx, `PREPARE p(`+st.types+`) AS `+st.sql); err != nil {
						return err
					}
					rows, err := tx.Query(ctx, `EXPLAIN (COSTS OFF) EXECUTE p(`+st.args+`)`)
					if err != nil {
						return err
					}
					lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
					if err != nil {
						return err
					}
					plan := strings.Join(lines, "\n")
					require.Contains(t, plan, "Index Scan using inbox_pkey on inbox i", "%s:\n%s", name, plan)
					for _, bad := range []string{"Seq Scan on inbox", "Bitmap", "Hash Join", "Merge Join"} {
						require.NotContains(t, plan, bad, "%s:\n%s", name, plan)
					}
					_, err = tx.Exec(ctx, `DEALLOCATE p`)
					return err
				})
				require.NoError(t, err)
			}
		})
	}
}
