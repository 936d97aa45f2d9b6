package effects

import (
	"context"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
)

// TestRecordFormsAgree: the outcome writes for several tenants (record,
// recordAgain) and for one (recordOne, recordAgainOne) record a batch of claimed
// effects once, and the retry of a write whose first run committed changes
// nothing and reports every outcome as recorded all the same. The Dispatcher's
// tests mostly record one tenant's outcomes, so this is where the forms for
// several tenants meet a retried write.
func TestRecordFormsAgree(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.Setup(t)
	for _, tc := range []struct {
		name    string
		tenants []string
	}{{"mixed", []string{"a", "b", "b"}}, {"one", []string{"a", "a", "a"}}} {
		_, err := pool.Exec(ctx, `TRUNCATE effects`)
		require.NoError(t, err)
		keys := []string{"k1", "k2", "k3"}
		for i := range keys {
			_, err := Enqueue(WithScope(ctx, Scope{Schema: schema, Tenant: tc.tenants[i]}), pool, Effect{Kind: "mail", Key: keys[i]})
			require.NoError(t, err)
		}
		// As a claim leaves them: fence 1, one attempt, in flight.
		_, err = pool.Exec(ctx, `UPDATE effects SET fence = 1, attempts = 1, in_flight = true`)
		require.NoError(t, err)

		q := newQueries(schema, 100, false)
		n := len(keys)
		kinds, states := slices.Repeat([]string{"mail"}, n), slices.Repeat([]string{"done"}, n)
		none := make([]*string, n)
		args := []any{tc.tenants, kinds, keys, slices.Repeat([]int64{1}, n), states, make([]int64, n),
			make([]bool, n), make([]int32, n), none, none, none}
		record, recordAgain := q.record, q.recordAgain
		if tc.name == "one" {
			record, recordAgain = q.recordOne, q.recordAgainOne
			args = append(args, tc.tenants[0])
		}
		recorded := func(sql string) []int64 {
			t.Helper()
			rows, err := pool.Query(ctx, sql, args...)
			require.NoError(t, err)
			got, err := pgx.CollectRows(rows, pgx.RowTo[int64])
			require.NoError(t, err)
			slices.Sort(got)
			return got
		}
		require.Equal(t, []int64{1, 2, 3}, recorded(record), tc.name)
		require.Equal(t, []int64{1, 2, 3}, recorded(recordAgain), "%s: a retry reports what the first run recorded", tc.name)
		require.Empty(t, recorded(record), "%s: record applies once", tc.name)
		require.Equal(t, n, pgtest.Count(t, pool, `SELECT count(*) FROM effects
			WHERE state = 'done' AND attempts = 1 AND NOT in_flight AND recorded_fence = 1`), tc.name)
	}
}
