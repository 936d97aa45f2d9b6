package effects

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/pgtest"
)

// On Citus, the one-tenant claim (without the plan settings, which stay the
// Dispatcher's on Citus to decide) and the one-tenant outcome writes run on the
// tenant's worker: the claim returns each due effect with its lag, and the
// outcome writes record done, retried and dead effects (with their times and
// failure group) once, a retry reporting what the first run recorded.
func TestCitusClaimAndOutcomeWritesOfOneTenant(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.CitusSetup(t, pgtest.Options{MaxConns: 4})
	keys := []string{"k1", "k2", "k3"}
	for _, tenant := range []string{"a", "b"} {
		for _, key := range keys {
			_, err := Enqueue(effectsdb.WithScope(ctx, effectsdb.Scope{Schema: schema, Source: effectsdb.Source{Tenant: tenant}}), pool, Effect{Kind: "mail", Key: key})
			require.NoError(t, err)
		}
	}
	one := newQueries(schema, 100, true)
	var claimed []string
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, one.claimCitus, []string{"mail"}, []int32{10}, time.Minute, "a")
		if err != nil {
			return err
		}
		for rows.Next() {
			vals, err := rows.Values()
			if err != nil {
				return err
			}
			require.Equal(t, "a", vals[0])
			require.GreaterOrEqual(t, vals[9].(float64), 0.0, "the lag")
			claimed = append(claimed, vals[2].(string))
		}
		return rows.Err()
	})
	require.NoError(t, err)
	slices.Sort(claimed)
	require.Equal(t, keys, claimed)

	n := len(keys)
	code, masked := "boom", "boom"
	args := []any{slices.Repeat([]string{"a"}, n), slices.Repeat([]string{"mail"}, n), keys, slices.Repeat([]int64{1}, n),
		[]string{"done", "pending", "dead"}, []int64{0, 60_000, 0}, make([]bool, n), make([]int32, n),
		[]*string{nil, &code, &code}, []*string{nil, nil, &code}, []*string{nil, nil, &masked}, "a"}
	recorded := func(sql string) []int64 {
		t.Helper()
		rows, err := pool.Query(ctx, sql, args...)
		require.NoError(t, err)
		got, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		require.NoError(t, err)
		slices.Sort(got)
		return got
	}
	require.Equal(t, []int64{1, 2, 3}, recorded(one.recordOne))
	require.Equal(t, []int64{1, 2, 3}, recorded(one.recordAgainOne), "a retry reports what the first run recorded")
	require.Empty(t, recorded(one.recordOne), "record applies once")
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE tenant = 'a' AND key = 'k1'
		AND state = 'done' AND done_at IS NOT NULL AND recorded_fence = 1`))
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE tenant = 'a' AND key = 'k2'
		AND state = 'pending' AND next_attempt_at > now() + interval '50 seconds' AND last_error = 'boom'`))
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE tenant = 'a' AND key = 'k3'
		AND state = 'dead' AND dead_at IS NOT NULL AND error_code = 'boom' AND length(error_group) = 8`))
	require.Equal(t, 3, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE tenant = 'b' AND state = 'pending' AND fence = 0`),
		"tenant b's effects untouched")
}

// On Citus, a Dispatcher for one tenant (Config.Tenant) sends that tenant's
// effects from the worker that holds them: a success is done, a transient
// failure is retried and then done, a permanent one is dead; another tenant's
// effects stay pending. Its claims and outcome writes go without the generic
// plan setting, which Citus cannot plan with.
func TestCitusDispatcherForOneTenant(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.CitusSetup(t, pgtest.Options{MaxConns: 6})
	for _, tenant := range []string{"a", "b"} {
		for _, key := range []string{"ok", "flaky", "doomed"} {
			_, err := Enqueue(effectsdb.WithScope(ctx, effectsdb.Scope{Schema: schema, Source: effectsdb.Source{Tenant: tenant}}), pool, Effect{Kind: "mail", Key: key})
			require.NoError(t, err)
		}
	}
	send := SenderFunc(func(_ context.Context, d Delivery) error {
		require.Equal(t, "a", d.Tenant)
		switch {
		case d.Key == "flaky" && d.Attempt == 1:
			return errors.New("again")
		case d.Key == "doomed":
			return Permanent(errors.New("never"))
		}
		return nil
	})
	d, err := NewDispatcher(Config{Pool: pool, Schema: schema, Tenant: "a", Senders: map[string]Sender{"mail": send},
		PollInterval: 20 * time.Millisecond, Backoff: Backoff{Initial: 10 * time.Millisecond, Max: 20 * time.Millisecond},
		Registerer: prometheus.NewRegistry()})
	require.NoError(t, err)
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- d.Run(runCtx) }()
	pgtest.WaitFor(t, 30*time.Second, "tenant a's effects settled", func() bool {
		return pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE tenant = 'a' AND state = 'pending'`) == 0
	})
	cancel()
	require.NoError(t, <-done)
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE tenant = 'a' AND key = 'ok' AND state = 'done' AND attempts = 1`))
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE tenant = 'a' AND key = 'flaky' AND state = 'done' AND attempts = 2`))
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE tenant = 'a' AND key = 'doomed' AND state = 'dead' AND dead_at IS NOT NULL`))
	require.Equal(t, 3, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE tenant = 'b' AND state = 'pending' AND attempts = 0`))
}
