package effectsdb

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"regexp"

	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/pgtest"
)

// TestEnqueueManyPlanNeedsNoStatistics: the cached plan of EnqueueItems's
// fingerprint read probes the primary key once per effect, on a table never
// analyzed as on a large analyzed one, rather than hashing the whole table.
func TestEnqueueManyPlanNeedsNoStatistics(t *testing.T) {
	t.Parallel()
	for _, table := range []string{"new", "analyzed"} {
		t.Run(table, func(t *testing.T) {
			t.Parallel()
			pool, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 2})
			ctx := context.Background()
			if table == "analyzed" {
				_, err := pool.Exec(ctx, `INSERT INTO effects (kind, key, payload, fingerprint)
					SELECT 'mail', 'k' || g, ''::bytea, sha256(''::bytea) FROM generate_series(1, 30000) g;
					ANALYZE effects`)
				require.NoError(t, err)
			}
			q := newQueries(schema)
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, `SET LOCAL plan_cache_mode = force_generic_plan`); err != nil {
					return err
				}
				if _, err := tx.Exec(ctx, `PREPARE p(text[], text[], text[]) AS `+q.fingerprintOf); err != nil {
					return err
				}
				rows, err := tx.Query(ctx, `EXPLAIN (COSTS OFF) EXECUTE p('{"",""}', '{mail,mail}', '{k1,k2}')`)
				if err != nil {
					return err
				}
				lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
				if err != nil {
					return err
				}
				plan := strings.Join(lines, "\n")
				require.Contains(t, plan, "Index Scan using effects_pkey", plan)
				for _, bad := range []string{"Seq Scan on effects", "Bitmap", "Hash Join", "Merge Join"} {
					require.NotContains(t, plan, bad, plan)
				}
				return nil
			})
			require.NoError(t, err)
		})
	}
}

// ValidKind and pgschema.Valid accept exactly what the documented patterns do.
func TestValidatorsMatchTheirPatterns(t *testing.T) {
	t.Parallel()
	alphabet := []byte("aZ09_.:/@+-x \x00é$A")
	var cases []string
	var gen func(prefix []byte, depth int)
	gen = func(prefix []byte, depth int) {
		cases = append(cases, string(prefix))
		if depth == 0 {
			return
		}
		for _, c := range alphabet {
			gen(append(prefix, c), depth-1)
		}
	}
	gen(nil, 3)
	cases = append(cases, strings.Repeat("a", 63), strings.Repeat("a", 64), strings.Repeat("k", 255), strings.Repeat("k", 256), "publish:orders", "_x9")
	kindRe := regexp.MustCompile(kindPattern)
	schemaRe := regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)
	for _, s := range cases {
		require.Equal(t, kindRe.MatchString(s), ValidKind(s), "kind %q", s)
		require.Equal(t, schemaRe.MatchString(s), pgschema.Valid(s), "schema %q", s)
	}
}
