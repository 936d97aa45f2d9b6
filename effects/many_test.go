package effects_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/pgtest"
)

// countingTx counts the statements sent through it.
type countingTx struct {
	pgx.Tx
	n int
}

func (c *countingTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	c.n++
	return c.Tx.Exec(ctx, sql, args...)
}

func (c *countingTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	c.n++
	return c.Tx.QueryRow(ctx, sql, args...)
}

// EnqueueMany writes many effects with one statement, and gives each the answer
// Enqueue would: new, a duplicate (stored before, or earlier in the same call), or
// a mismatch, which names its item.
func TestEnqueueMany(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.Setup(t)
	scope := effectsdb.Scope{Schema: schema, Source: effectsdb.Source{Consumer: "payments", Tenant: "acme", Key: "pay-1"}}
	many := func(effs []effects.Effect) (res []effects.Result, statements int, err error) {
		err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			ct := &countingTx{Tx: tx}
			res, err = effects.EnqueueMany(effectsdb.WithScope(ctx, scope), ct, effs)
			statements = ct.n
			return err
		})
		return res, statements, err
	}
	e := func(key, payload string) effects.Effect {
		return effects.Effect{Kind: "email", Key: key, Payload: []byte(payload), MaxAttempts: 3, Delay: time.Hour}
	}

	res, n, err := many([]effects.Effect{e("b", "1"), e("a", "2"), e("b", "1")})
	require.NoError(t, err)
	require.Equal(t, 1, n, "one statement when nothing was there")
	require.Equal(t, []effects.Result{{}, {}, {Duplicate: true}}, res)
	var tenant, src string
	var attempts int
	var later bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT tenant, source_key, max_attempts, next_attempt_at > now() + interval '50 minutes'
		FROM effects WHERE key = 'a'`).Scan(&tenant, &src, &attempts, &later))
	require.Equal(t, "acme", tenant)
	require.Equal(t, "pay-1", src)
	require.Equal(t, 3, attempts)
	require.True(t, later, "the delay is kept")

	res, n, err = many([]effects.Effect{e("c", "3"), e("a", "2"), e("b", "other"), e("c", "changed")})
	var ie *effectsdb.ItemErrors
	require.ErrorAs(t, err, &ie)
	require.Equal(t, 2, n, "a second statement reads the rows the insert met")
	require.NoError(t, ie.Errs[0])
	require.NoError(t, ie.Errs[1])
	require.ErrorIs(t, ie.Errs[2], effects.ErrFingerprintMismatch, "b is stored with another payload")
	require.ErrorIs(t, ie.Errs[3], effects.ErrFingerprintMismatch, "c came earlier in the call with another payload")
	require.ErrorIs(t, err, effects.ErrFingerprintMismatch)
	require.Contains(t, err.Error(), "item 2")
	require.Equal(t, effects.Result{Duplicate: true}, res[1])

	_, _, err = many([]effects.Effect{e("d", "4"), {Kind: "bad kind", Key: "k"}})
	require.ErrorIs(t, err, effects.ErrInvalidKind)
	require.ErrorAs(t, err, &ie)
	require.Error(t, ie.Errs[1])

	_, err = effects.EnqueueMany(ctx, nil, nil)
	require.ErrorIs(t, err, effects.ErrNoTx)
	require.Equal(t, 2, pgtest.Count(t, pool, `SELECT count(*) FROM effects`))
}

// With a Buffer in the scope, Enqueue and EnqueueMany write nothing: they check the
// effect and keep it for the batch's one write. After the buffer is closed, an
// enqueue is refused rather than lost.
func TestBufferedEnqueue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.Setup(t)
	buf := effectsdb.NewBuffer()
	scope := effectsdb.Scope{Schema: schema, Source: effectsdb.Source{Consumer: "c", Key: "m"}, Kinds: []string{"email"}, Buffer: buf}
	sctx := effectsdb.WithScope(ctx, scope)
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		ct := &countingTx{Tx: tx}
		res, err := effects.Enqueue(sctx, ct, effects.Effect{Kind: "email", Key: "a", Payload: []byte("1")})
		require.NoError(t, err)
		require.Equal(t, effects.Result{Deferred: true}, res)
		results, err := effects.EnqueueMany(sctx, ct, []effects.Effect{{Kind: "email", Key: "b"}, {Kind: "email", Key: "c"}})
		require.NoError(t, err)
		require.Len(t, results, 2)
		require.True(t, results[1].Deferred)
		_, err = effects.Enqueue(sctx, ct, effects.Effect{Kind: "sms", Key: "x"})
		require.ErrorIs(t, err, effects.ErrUnknownKind, "checked at once")
		require.Zero(t, ct.n, "nothing written yet")

		items := buf.Close()
		require.Len(t, items, 3)
		require.Nil(t, items[0].Scope.Buffer)
		_, err = effects.Enqueue(sctx, ct, effects.Effect{Kind: "email", Key: "late"})
		require.ErrorIs(t, err, effects.ErrBufferClosed)
		require.Equal(t, "effect_buffer_closed", inbox.Code(err))

		_, err = effectsdb.EnqueueItems(ctx, ct, items)
		require.Equal(t, 1, ct.n)
		return err
	})
	require.NoError(t, err)
	require.Equal(t, 3, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE source_key = 'm'`))
}

// Two transactions that enqueue the same keys in opposite orders write them in one
// order, so they wait for each other instead of deadlocking; the second sees the
// first's rows as duplicates.
func TestEnqueueManySortsSoWritersCannotDeadlock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.Setup(t)
	scope := effectsdb.Scope{Schema: schema}
	holder, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer holder.Rollback(ctx)
	_, err = effectsdb.Enqueue(ctx, holder, scope, effectsdb.Effect{Kind: "k", Key: "m"})
	require.NoError(t, err)

	var wg sync.WaitGroup
	errs := make([]error, 2)
	results := make([][]effects.Result, 2)
	for w, order := range [][]string{{"z", "m", "a"}, {"a", "m", "z"}} {
		wg.Go(func() {
			effs := make([]effects.Effect, len(order))
			for i, k := range order {
				effs[i] = effects.Effect{Kind: "k", Key: k}
			}
			errs[w] = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) (err error) {
				results[w], err = effects.EnqueueMany(effectsdb.WithScope(ctx, scope), tx, effs)
				return err
			})
		})
	}
	pgtest.WaitFor(t, 30*time.Second, "both writers wait", func() bool {
		return pgtest.Count(t, pool, `SELECT count(*) FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND query LIKE '%unnest%' AND application_name = $1`, "idem-test:"+schema) >= 2
	})
	require.NoError(t, holder.Rollback(ctx))
	wg.Wait()
	dups := 0
	for w, err := range errs {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) {
			require.NotEqual(t, pgerrcode.DeadlockDetected, pgErr.Code, "deadlock")
		}
		require.NoError(t, err)
		for _, r := range results[w] {
			if r.Duplicate {
				dups++
			}
		}
	}
	require.Equal(t, 3, dups, "the second writer met the first one's rows")
	require.Equal(t, 3, pgtest.Count(t, pool, `SELECT count(*) FROM effects
		WHERE source_consumer IS NULL AND source_tenant IS NULL AND source_key IS NULL`), "no source recorded without a consumer")
}

// EnqueueItems sends the columns in which every effect has the default as NULL
// arrays: each row still gets its own max_attempts, delay and trace context
// whether the others have the default or not, in whichever order they come, and
// an effect with a source keeps its tenant as the source's. Its form for Citus
// (Scope.Citus: one single-row insert an effect) writes the same rows and gives
// the same results.
func TestEnqueueItemsDefaultsAndOverrides(t *testing.T) {
	t.Parallel()
	for name, enqueue := range map[string]func(context.Context, pgx.Tx, []effectsdb.Item) ([]effectsdb.Result, error){
		"EnqueueItems": func(ctx context.Context, tx pgx.Tx, items []effectsdb.Item) ([]effectsdb.Result, error) {
			return effectsdb.EnqueueItems(ctx, tx, items)
		},
		// The form for Citus: one single-row insert an effect.
		"EnqueueItems on Citus": func(ctx context.Context, tx pgx.Tx, items []effectsdb.Item) ([]effectsdb.Result, error) {
			items = slices.Clone(items)
			for i := range items {
				items[i].Scope.Citus = true
			}
			return effectsdb.EnqueueItems(ctx, tx, items)
		},
	} {
		t.Run(name, func(t *testing.T) { testEnqueueItemsDefaultsAndOverrides(t, enqueue) })
	}
}

func testEnqueueItemsDefaultsAndOverrides(t *testing.T, enqueue func(context.Context, pgx.Tx, []effectsdb.Item) ([]effectsdb.Result, error)) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.Setup(t)
	traced := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1}, SpanID: trace.SpanID{2}, TraceFlags: trace.FlagsSampled})
	src := effectsdb.Scope{Schema: schema, Source: effectsdb.Source{Consumer: "c", Tenant: "acme", Key: "m1"}}
	plain := effectsdb.Scope{Schema: schema}
	items := []effectsdb.Item{
		{Scope: src, Effect: effectsdb.Effect{Kind: "k", Key: "1-default"}},
		{Scope: src, Effect: effectsdb.Effect{Kind: "k", Key: "2-attempts", MaxAttempts: 3}},
		{Scope: plain, Effect: effectsdb.Effect{Kind: "k", Key: "3-delay", Delay: time.Hour}},
		{Scope: src, Effect: effectsdb.Effect{Kind: "k", Key: "4-traced"}, Trace: traced},
		{Scope: plain, Effect: effectsdb.Effect{Kind: "k", Key: "5-default"}},
	}
	for _, order := range [][]int{{0, 1, 2, 3, 4}, {4, 3, 2, 1, 0}} {
		_, err := pool.Exec(ctx, `TRUNCATE effects`)
		require.NoError(t, err)
		var batch []effectsdb.Item
		for _, i := range order {
			batch = append(batch, items[i])
		}
		require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := enqueue(ctx, tx, batch)
			return err
		}))
		rows, err := pool.Query(ctx, `SELECT key, tenant, max_attempts, next_attempt_at > now() + interval '50 minutes',
				trace_context IS NOT NULL, coalesce(source_tenant, '-'), coalesce(source_key, '-')
			FROM effects ORDER BY key`)
		require.NoError(t, err)
		type row struct {
			key, tenant       string
			attempts          int
			delayed, traced   bool
			srcTenant, srcKey string
		}
		got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (row, error) {
			var x row
			err := r.Scan(&x.key, &x.tenant, &x.attempts, &x.delayed, &x.traced, &x.srcTenant, &x.srcKey)
			return x, err
		})
		require.NoError(t, err)
		require.Equal(t, []row{
			{"1-default", "acme", effects.DefaultMaxAttempts, false, false, "acme", "m1"},
			{"2-attempts", "acme", 3, false, false, "acme", "m1"},
			{"3-delay", "", effects.DefaultMaxAttempts, true, false, "-", "-"},
			{"4-traced", "acme", effects.DefaultMaxAttempts, false, true, "acme", "m1"},
			{"5-default", "", effects.DefaultMaxAttempts, false, false, "-", "-"},
		}, got, "order %v", order)

		// The same effects again, of two tenants, one with another payload: the
		// conflict read for several tenants finds each stored row.
		again := slices.Clone(batch)
		changed := slices.IndexFunc(again, func(it effectsdb.Item) bool { return it.Effect.Key == "3-delay" })
		again[changed].Effect.Payload = []byte("other")
		var res []effectsdb.Result
		err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) (err error) {
			res, err = enqueue(ctx, tx, again)
			return err
		})
		var ie *effectsdb.ItemErrors
		require.ErrorAs(t, err, &ie, "order %v", order)
		for i := range again {
			if i == changed {
				require.ErrorIs(t, ie.Errs[i], effects.ErrFingerprintMismatch, "order %v", order)
				continue
			}
			require.NoError(t, ie.Errs[i])
			require.Equal(t, effectsdb.Result{Duplicate: true}, res[i], "order %v: %s", order, again[i].Effect.Key)
		}
	}
}
