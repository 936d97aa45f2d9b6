package effects_test

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/pgtest"
)

func enqueueIn(t testing.TB, pool *pgxpool.Pool, scope effectsdb.Scope, e effects.Effect) (effects.Result, error) {
	t.Helper()
	ctx := context.Background()
	var res effects.Result
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var err error
		res, err = effects.Enqueue(effectsdb.WithScope(ctx, scope), tx, e)
		return err
	})
	return res, err
}

// TestEnqueueTenantScope: an effect's identity is (tenant, kind, key). Two tenants'
// receipt:123 are two effects, neither a duplicate nor a mismatch of the other, and
// each Delivery carries its tenant. (Before, tenant B's Enqueue returned Duplicate,
// or ErrFingerprintMismatch with another payload, because tenant A had the key.)
func TestEnqueueTenantScope(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	scope := func(tenant string) effectsdb.Scope {
		return effectsdb.Scope{Schema: schema, Source: effectsdb.Source{Consumer: "payments", Tenant: tenant, Key: "pay_123"}}
	}
	e := func(payload string) effects.Effect {
		return effects.Effect{Kind: "mail", Key: "receipt:123", Payload: []byte(payload)}
	}
	for _, tc := range []struct{ tenant, payload string }{{"acme", `{"to":"a"}`}, {"globex", `{"to":"g"}`}, {"", `{"to":"u"}`}} {
		res, err := enqueueIn(t, pool, scope(tc.tenant), e(tc.payload))
		require.NoError(t, err, tc.tenant)
		require.False(t, res.Duplicate, "tenant %q: not another tenant's duplicate", tc.tenant)
	}
	res, err := enqueueIn(t, pool, scope("globex"), e(`{"to":"g"}`))
	require.NoError(t, err)
	require.True(t, res.Duplicate, "the same tenant's same effect is a duplicate")
	_, err = enqueueIn(t, pool, scope("globex"), e(`{"to":"changed"}`))
	require.ErrorIs(t, err, effects.ErrFingerprintMismatch)
	require.ErrorContains(t, err, `tenant "globex"`)
	// A tenant without a source (enqueued outside a consumer) scopes the effect too.
	res, err = enqueueIn(t, pool, effectsdb.Scope{Schema: schema, Source: effectsdb.Source{Tenant: "initech"}}, e(`{"to":"i"}`))
	require.NoError(t, err)
	require.False(t, res.Duplicate)
	require.Equal(t, 4, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE kind = 'mail' AND key = 'receipt:123'`))
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE tenant = 'initech' AND source_consumer IS NULL`))

	_, err = enqueueIn(t, pool, effectsdb.Scope{Schema: schema, Source: effectsdb.Source{Tenant: "bad\x00"}}, e(`{}`))
	require.ErrorIs(t, err, effects.ErrInvalidTenant)

	rec := newRecorder(nil)
	start(t, fastConfig(pool, schema, map[string]effects.Sender{"mail": rec}))
	pgtest.WaitFor(t, 20*time.Second, "all four sent", func() bool { return countState(t, pool, "done") == 4 })
	rec.mu.Lock()
	sends := slices.Clone(rec.sends["receipt:123"])
	rec.mu.Unlock()
	got := map[string]string{}
	for _, d := range sends {
		require.Equal(t, 1, d.Attempt)
		got[d.Tenant] = string(d.Payload)
		if d.SourceConsumer != "" {
			require.Equal(t, d.Tenant, d.SourceTenant, "a consumer's effect has its message's tenant")
		}
	}
	require.Equal(t, map[string]string{"acme": `{"to":"a"}`, "globex": `{"to":"g"}`, "": `{"to":"u"}`, "initech": `{"to":"i"}`}, got)
}

// TestRequeueDeadByTenant: a requeue can be narrowed to one tenant; without a tenant
// it takes the key in every tenant.
func TestRequeueDeadByTenant(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	ctx := context.Background()
	for _, tenant := range []string{"acme", "globex", ""} {
		_, err := enqueueIn(t, pool, effectsdb.Scope{Schema: schema, Source: effectsdb.Source{Tenant: tenant}}, effects.Effect{Kind: "mail", Key: "k"})
		require.NoError(t, err)
	}
	_, err := pool.Exec(ctx, `UPDATE effects SET state = 'dead'`)
	require.NoError(t, err)
	n, err := effectsdb.RequeueDead(ctx, pool, schema, effectsdb.RequeueFilter{Kind: "mail", Key: "k", Tenant: "acme"})
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	require.Equal(t, "pending", stateOf(t, pool, "acme", "mail", "k"))
	require.Equal(t, "dead", stateOf(t, pool, "globex", "mail", "k"))
	n, err = effectsdb.RequeueDead(ctx, pool, schema, effectsdb.RequeueFilter{Key: "k"})
	require.NoError(t, err)
	require.EqualValues(t, 2, n, "no tenant: every tenant's k")
}

// TestRequeueDeadTenantExact: with TenantExact, the empty tenant is the unscoped
// effect alone, so requeueing one effect by its identity never takes another
// tenant's effect of the same kind and key.
func TestRequeueDeadTenantExact(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	ctx := context.Background()
	for _, tenant := range []string{"acme", ""} {
		_, err := enqueueIn(t, pool, effectsdb.Scope{Schema: schema, Source: effectsdb.Source{Tenant: tenant}}, effects.Effect{Kind: "mail", Key: "k"})
		require.NoError(t, err)
	}
	_, err := pool.Exec(ctx, `UPDATE effects SET state = 'dead'`)
	require.NoError(t, err)
	n, err := effectsdb.RequeueDead(ctx, pool, schema, effectsdb.RequeueFilter{Kind: "mail", Key: "k", TenantExact: true})
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	require.Equal(t, "pending", stateOf(t, pool, "", "mail", "k"))
	require.Equal(t, "dead", stateOf(t, pool, "acme", "mail", "k"), "another tenant's effect stays dead")
	n, err = effectsdb.RequeueDead(ctx, pool, schema, effectsdb.RequeueFilter{TenantExact: true})
	require.NoError(t, err)
	require.Zero(t, n, "TenantExact alone takes the unscoped dead effects: none left")
}

func stateOf(t testing.TB, pool *pgxpool.Pool, tenant, kind, key string) string {
	t.Helper()
	var s string
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT state FROM effects WHERE tenant = $1 AND kind = $2 AND key = $3`,
		tenant, kind, key).Scan(&s))
	return s
}

// TestLedgerSenderTenantScope: with a TenantColumn, two tenants' same key are two
// ledger rows; without one, a tenant's effect is refused (permanent) instead of
// being dropped as a repeat of another tenant's row.
func TestLedgerSenderTenantScope(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE ledger (tenant text NOT NULL, effect_key text NOT NULL, payload jsonb NOT NULL,
		PRIMARY KEY (tenant, effect_key))`)
	require.NoError(t, err)
	scoped, err := effects.NewLedgerSender(effects.LedgerConfig{Pool: pool, Table: schema + ".ledger", TenantColumn: "tenant"})
	require.NoError(t, err)
	for _, tenant := range []string{"acme", "globex", "acme"} {
		require.NoError(t, scoped.Send(ctx, effects.Delivery{Tenant: tenant, Kind: "ledger", Key: "credit:1", Payload: []byte(`{"amount":1}`)}))
	}
	require.Equal(t, 2, pgtest.Count(t, pool, `SELECT count(*) FROM ledger WHERE effect_key = 'credit:1'`))

	_, err = pool.Exec(ctx, `CREATE TABLE plain (effect_key text PRIMARY KEY, payload jsonb NOT NULL)`)
	require.NoError(t, err)
	plain, err := effects.NewLedgerSender(effects.LedgerConfig{Pool: pool, Table: schema + ".plain"})
	require.NoError(t, err)
	require.NoError(t, plain.Send(ctx, effects.Delivery{Kind: "ledger", Key: "credit:1", Payload: []byte(`{}`)}))
	err = plain.Send(ctx, effects.Delivery{Tenant: "acme", Kind: "ledger", Key: "credit:2", Payload: []byte(`{}`)})
	require.True(t, inbox.IsPermanent(err), "%v", err)
	require.ErrorContains(t, err, "TenantColumn")
}

// TestPublishSenderPassesTenant: a tenant-scoped publish effect's message carries the
// tenant in TenantMetadataKey, so a scoped consumer downstream keeps the scope.
func TestPublishSenderPassesTenant(t *testing.T) {
	t.Parallel()
	pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 10}, watermill.NopLogger{})
	defer func() { require.NoError(t, pubsub.Close()) }()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	msgs, err := pubsub.Subscribe(ctx, "orders")
	require.NoError(t, err)
	send := effects.PublishSender(pubsub)
	for _, tenant := range []string{"acme", ""} {
		e, err := effects.PublishEffect("orders", message.NewMessage(watermill.NewUUID(), []byte(`{}`)))
		require.NoError(t, err)
		require.NoError(t, send.Send(ctx, effects.Delivery{Tenant: tenant, Kind: e.Kind, Key: e.Key, Payload: e.Payload}))
		got := <-msgs
		got.Ack()
		require.Equal(t, tenant, got.Metadata.Get(effects.TenantMetadataKey))
	}
}

// TestEnqueueDelayCountsFromTheCall: the due time is at least Delay after the Enqueue
// call, even in a transaction that started long before it. (Before, Delay counted
// from the start of the transaction: a 2 s delay in a transaction that had run 3 s
// was due before the commit.)
func TestEnqueueDelayCountsFromTheCall(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	ctx := context.Background()
	const delay = 2 * time.Second
	var called, due time.Time
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_sleep(1.5)`); err != nil {
			return err
		}
		if err := tx.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&called); err != nil {
			return err
		}
		if _, err := effects.Enqueue(effects.WithScope(ctx, effects.Scope{Schema: schema}), tx, effects.Effect{Kind: "mail", Key: "later", Delay: delay}); err != nil {
			return err
		}
		return tx.QueryRow(ctx, `SELECT next_attempt_at FROM effects WHERE key = 'later'`).Scan(&due)
	})
	require.NoError(t, err)
	require.GreaterOrEqual(t, due.Sub(called), delay, "due %s after the call", due.Sub(called))
	require.Less(t, due.Sub(called), delay+time.Minute)
}

// TestDispatcherTenantFilter: a Dispatcher with Config.Tenant claims and sends only
// that tenant's effects (sent, retried after a failure, dead after a permanent one),
// and leaves the other tenant's untouched though they are due the whole time: no
// attempt, no fence, no send. An unfiltered Dispatcher then sends the rest.
func TestDispatcherTenantFilter(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	for _, tenant := range []string{"a", "b"} {
		for _, key := range []string{"k1", "k2", "k3", "flaky", "doomed"} {
			_, err := enqueueIn(t, pool, effectsdb.Scope{Schema: schema, Source: effectsdb.Source{Tenant: tenant}},
				effects.Effect{Kind: "mail", Key: key, Payload: []byte(tenant + key)})
			require.NoError(t, err)
		}
	}
	rec := newRecorder(func(_ context.Context, d effects.Delivery) error {
		switch {
		case d.Key == "flaky" && d.Attempt == 1:
			return errors.New("try again")
		case d.Key == "doomed":
			return effects.Permanent(errors.New("never"))
		}
		return nil
	})
	cfg := fastConfig(pool, schema, map[string]effects.Sender{"mail": rec})
	cfg.Tenant = "a"
	stop := start(t, cfg)
	count := func(tenant, state string) int {
		return pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE tenant = $1 AND state = $2`, tenant, state)
	}
	pgtest.WaitFor(t, 20*time.Second, "tenant a's effects settled", func() bool {
		return count("a", "done") == 4 && count("a", "dead") == 1
	})
	stop()
	require.Equal(t, 2, pgtest.Count(t, pool, `SELECT attempts FROM effects WHERE tenant = 'a' AND key = 'flaky'`),
		"a's flaky effect was claimed twice, so b's were due during two claims at least")
	require.Equal(t, 5, pgtest.Count(t, pool, `SELECT count(*) FROM effects
		WHERE tenant = 'b' AND state = 'pending' AND attempts = 0 AND fence = 0 AND NOT in_flight AND recorded_fence = 0`),
		"the filtered Dispatcher touched none of b's effects")
	rec.mu.Lock()
	for key, sends := range rec.sends {
		for _, d := range sends {
			require.Equal(t, "a", d.Tenant, "key %s sent for another tenant", key)
		}
	}
	rec.mu.Unlock()

	cfg.Tenant = ""
	start(t, cfg)
	pgtest.WaitFor(t, 20*time.Second, "tenant b's effects settled by an unfiltered Dispatcher", func() bool {
		return count("b", "done") == 4 && count("b", "dead") == 1
	})
	require.Equal(t, 4, count("a", "done"), "a's effects stay as they were")
	require.Equal(t, 1, count("a", "dead"))
	rec.mu.Lock()
	sentTo := map[string]int{}
	for _, sends := range rec.sends {
		for _, d := range sends {
			sentTo[d.Tenant]++
		}
	}
	rec.mu.Unlock()
	require.Equal(t, map[string]int{"a": 6, "b": 6}, sentTo, "per tenant: 3 sends, flaky twice, doomed once")
}
