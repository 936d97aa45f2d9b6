package admin_test

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/migrate"
	"github.com/idemkit/idem/shard"
)

// citusSetup is setup on a schema migrated in Citus mode, with failures of two
// tenants of each worker written by the real writers: for each tenant, 2 failed
// inbox keys of consumer orders (one group a tenant), 2 completed keys, 2 dead
// effects of kind email (one group a tenant), 1 pending and 1 done.
func citusSetup(t *testing.T) (*admin.Admin, *testBundle, []string) {
	t.Helper()
	t.Parallel()
	pool, schema := pgtest.CitusSetup(t, pgtest.Options{MaxConns: 6})
	logs := &syncBuffer{}
	a, err := admin.New(admin.Config{Pool: pool, Schema: schema, Logger: slog.New(slog.NewJSONHandler(logs, nil))})
	require.NoError(t, err)
	b := &testBundle{pool: pool, schema: schema, logs: logs}
	w1, w2 := pgtest.CitusTenants(t, pool, schema, "t", 2)
	tenants := slices.Sorted(slices.Values(slices.Concat(w1, w2)))
	ctx := context.Background()
	for _, tenant := range tenants {
		b.failKeys(t, "orders", tenant, "f", "bad_payload", 2, func(i int) string { return fmt.Sprintf("order %d of %s: bad amount", i, tenant) })
		b.exec(t, `INSERT INTO inbox (consumer, tenant, key, fingerprint, state, completed_at, expires_at)
			SELECT 'orders', $1, 'c' || i, '\x01', 'completed', now(), now() + interval '1 day' FROM generate_series(0, 1) i`, tenant)
		sctx := effects.WithScope(ctx, effects.Scope{Schema: schema, Tenant: tenant})
		for i := range 2 {
			_, err := effects.Enqueue(sctx, pool, effects.Effect{Kind: "email", Key: fmt.Sprintf("d%d", i), Payload: []byte(`{}`)})
			require.NoError(t, err)
		}
	}
	b.dispatchUntil(t, map[string]effects.Sender{"email": effects.SenderFunc(func(_ context.Context, d effects.Delivery) error {
		return effects.Permanent(&codedErr{code: "rejected", msg: "provider rejected " + d.Tenant + "/" + d.Key})
	})}, `SELECT count(*) = 8 FROM effects WHERE state = 'dead'`)
	for _, tenant := range tenants {
		sctx := effects.WithScope(ctx, effects.Scope{Schema: schema, Tenant: tenant})
		_, err := effects.Enqueue(sctx, pool, effects.Effect{Kind: "email", Key: "p0", Payload: []byte(`{}`), Delay: time.Hour})
		require.NoError(t, err)
		b.exec(t, `INSERT INTO effects (tenant, kind, key, fingerprint, state, done_at) VALUES ($1, 'email', 'ok0', '\x00', 'done', now())`, tenant)
	}
	return a, b, tenants
}

// countOf reads one count.
func (b *testBundle) countOf(t *testing.T, sql string, args ...any) int64 {
	t.Helper()
	var n int64
	require.NoError(t, b.pool.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}

// On Citus every read of the operator API answers with the rows of every tenant
// of both workers.
func TestCitusAdminReads(t *testing.T) {
	a, b, tenants := citusSetup(t)
	ctx := context.Background()

	st, err := a.Stats(ctx)
	require.NoError(t, err)
	require.Len(t, st.Consumers, 1)
	require.Equal(t, admin.ConsumerStats{Consumer: "orders", Rows: 16, Completed: 8, Failed: 8},
		admin.ConsumerStats{Consumer: st.Consumers[0].Consumer, Rows: st.Consumers[0].Rows, Completed: st.Consumers[0].Completed, Failed: st.Consumers[0].Failed})
	require.Len(t, st.Effects, 1)
	require.Equal(t, []int64{4, 0, 8, 4, 0}, []int64{st.Effects[0].Pending, st.Effects[0].Due, st.Effects[0].Dead, st.Effects[0].Done, st.Effects[0].Discarded})

	reg := prometheus.NewRegistry()
	_, err = admin.New(admin.Config{Pool: b.pool, Schema: b.schema, Registerer: reg})
	require.NoError(t, err)
	mfs, err := reg.Gather()
	require.NoError(t, err)
	metrics := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			metrics[mf.GetName()+"{"+m.GetLabel()[0].GetValue()+"}"] = m.GetGauge().GetValue()
		}
	}
	require.Equal(t, 8.0, metrics["idem_inbox_failed_keys{orders}"])
	require.Equal(t, 8.0, metrics["idem_effects_dead_rows{email}"])

	act, err := a.Activity(ctx, time.Hour)
	require.NoError(t, err)
	var completed, failed, dead, sent int64
	for _, m := range act.Minutes {
		completed, failed, dead, sent = completed+m.Completed, failed+m.Failed, dead+m.Dead, sent+m.Sent
	}
	require.Equal(t, []int64{8, 8, 8, 4}, []int64{completed, failed, dead, sent})

	keys, err := a.ListInbox(ctx, admin.InboxFilter{State: "failed"}, admin.Page{Limit: 3})
	require.NoError(t, err)
	var all []string
	for {
		for _, k := range keys.Rows {
			all = append(all, k.Tenant+"/"+k.Key)
		}
		if keys.Next == "" {
			break
		}
		keys, err = a.ListInbox(ctx, admin.InboxFilter{State: "failed"}, admin.Page{Limit: 3, After: keys.Next})
		require.NoError(t, err)
	}
	var want []string
	for _, tenant := range tenants {
		want = append(want, tenant+"/f0", tenant+"/f1")
	}
	require.Equal(t, want, all, "every failed key of both workers, in key order, over pages")
	one, err := a.ListInbox(ctx, admin.InboxFilter{Tenant: &tenants[3], KeyPrefix: "c"}, admin.Page{})
	require.NoError(t, err)
	require.Len(t, one.Rows, 2)

	effs, err := a.ListEffects(ctx, admin.EffectFilter{State: "dead"}, admin.Page{Limit: 5})
	require.NoError(t, err)
	require.Len(t, effs.Rows, 5)
	require.NotEmpty(t, effs.Next)
	effs, err = a.ListEffects(ctx, admin.EffectFilter{State: "dead"}, admin.Page{Limit: 5, After: effs.Next})
	require.NoError(t, err)
	require.Len(t, effs.Rows, 3)
	stuck, err := a.ListEffects(ctx, admin.EffectFilter{Stuck: true}, admin.Page{})
	require.NoError(t, err)
	require.Empty(t, stuck.Rows)

	in, err := a.InspectInbox(ctx, inbox.ID{Consumer: "orders", Tenant: tenants[2], Key: "f1"}, admin.InspectOptions{Body: true})
	require.NoError(t, err)
	require.Equal(t, "failed", in.State)
	require.Equal(t, "bad_payload", in.ErrorCode)
	e, err := a.InspectEffect(ctx, admin.EffectID{Tenant: tenants[1], Kind: "email", Key: "d1"})
	require.NoError(t, err)
	require.Equal(t, "dead", e.State)

	found, err := a.Find(ctx, "d0", admin.FindFilter{})
	require.NoError(t, err)
	require.Len(t, found.Effects, 4, "one d0 of each tenant")
	found, err = a.Find(ctx, "f0", admin.FindFilter{Tenant: &tenants[0]})
	require.NoError(t, err)
	require.Len(t, found.Inbox, 1)
	require.Equal(t, tenants[0], found.Inbox[0].Tenant)

	groups := groupsOf(t, a, admin.GroupFilter{})
	require.Len(t, groups, 8, "one inbox and one effects group a tenant")
	for _, g := range groups {
		require.EqualValues(t, 2, g.Count)
		require.Len(t, g.SampleKeys, 2)
	}
	page, err := a.ListGroups(ctx, admin.GroupFilter{Source: admin.SourceEffects}, admin.Page{Limit: 3})
	require.NoError(t, err)
	require.Len(t, page.Rows, 3)
	page, err = a.ListGroups(ctx, admin.GroupFilter{Source: admin.SourceEffects}, admin.Page{Limit: 3, After: page.Next})
	require.NoError(t, err)
	require.Len(t, page.Rows, 1)
	for code, source := range map[string]string{"bad_payload": admin.SourceInbox, "rejected": admin.SourceEffects} {
		byCode := groupsOf(t, a, admin.GroupFilter{Code: code})
		require.Len(t, byCode, 4, code)
		for _, g := range byCode {
			require.Equal(t, source, g.Source)
		}
	}
	g, err := a.Group(ctx, groups[0].ID, admin.TimeRange{})
	require.NoError(t, err)
	require.EqualValues(t, 2, g.Count)
	require.Len(t, g.SampleKeys, 2)
}

// groupOf is the group of source for tenant.
func groupOf(t *testing.T, a *admin.Admin, source, tenant string) admin.FailureGroup {
	t.Helper()
	for _, g := range groupsOf(t, a, admin.GroupFilter{Source: source}) {
		if g.Tenant == tenant {
			return g
		}
	}
	t.Fatalf("no %s group of tenant %s", source, tenant)
	return admin.FailureGroup{}
}

// On Citus a failure group's retry, discard and release change the group's rows
// on the worker that holds them and store the action in the reference table, in
// one transaction; the audit trail lists them.
func TestCitusGroupActions(t *testing.T) {
	a, b, tenants := citusSetup(t)
	ctx := context.Background()
	note := admin.Audit{Who: "ops", Why: "provider fixed"}

	// The dispatchers listen on the coordinator: a retry wakes them there.
	listen, err := b.pool.Acquire(ctx)
	require.NoError(t, err)
	defer listen.Release()
	_, err = listen.Exec(ctx, `LISTEN idem_effects`)
	require.NoError(t, err)

	retry := groupOf(t, a, admin.SourceEffects, tenants[0])
	plan, err := a.RetryGroup(ctx, admin.GroupAction{ID: retry.ID, Through: retry.LastSeen, DryRun: true})
	require.NoError(t, err)
	require.EqualValues(t, 2, plan.Rows)
	require.Equal(t, []string{"d0", "d1"}, plan.Keys)
	require.Zero(t, b.countOf(t, `SELECT count(*) FROM failure_actions`), "a dry run records nothing")
	res, err := a.RetryGroup(ctx, admin.GroupAction{ID: retry.ID, Through: retry.LastSeen, AtMost: plan.Rows, Note: note})
	require.NoError(t, err)
	require.EqualValues(t, 2, res.Rows)
	require.NotEmpty(t, res.ActionID)
	require.EqualValues(t, 2, b.countOf(t, `SELECT count(*) FROM effects WHERE tenant = $1 AND key LIKE 'd%' AND state = 'pending' AND attempts = 0`, tenants[0]))
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	n, err := listen.Conn().WaitForNotification(wctx)
	require.NoError(t, err)
	require.Equal(t, b.schema, n.Payload)

	discard := groupOf(t, a, admin.SourceEffects, tenants[3])
	res, err = a.DiscardGroup(ctx, admin.GroupAction{ID: discard.ID, Through: discard.LastSeen, Note: note})
	require.NoError(t, err)
	require.EqualValues(t, 2, res.Rows)
	require.EqualValues(t, 2, b.countOf(t, `SELECT count(*) FROM effects WHERE tenant = $1 AND key LIKE 'd%' AND state = 'discarded' AND done_at IS NOT NULL`, tenants[3]))

	release := groupOf(t, a, admin.SourceInbox, tenants[2])
	res, err = a.ReleaseGroup(ctx, admin.GroupAction{ID: release.ID, Through: release.LastSeen, Note: note})
	require.NoError(t, err)
	require.EqualValues(t, 2, res.Rows)
	require.Zero(t, b.countOf(t, `SELECT count(*) FROM inbox WHERE tenant = $1 AND state = 'failed'`, tenants[2]))

	// The other tenants' failures are untouched.
	require.EqualValues(t, 4, b.countOf(t, `SELECT count(*) FROM effects WHERE state = 'dead'`))
	require.EqualValues(t, 6, b.countOf(t, `SELECT count(*) FROM inbox WHERE state = 'failed'`))

	// The stored actions, one row each, with the group's place and tenant.
	rows, err := b.pool.Query(ctx, `SELECT action, source, place, tenant, affected, who, why FROM failure_actions ORDER BY action`)
	require.NoError(t, err)
	type stored struct {
		Action, Source, Place, Tenant string
		Affected                      int64
		Who, Why                      string
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[stored])
	require.NoError(t, err)
	require.Equal(t, []stored{
		{"discard", "effects", "email", tenants[3], 2, "ops", "provider fixed"},
		{"release", "inbox", "orders", tenants[2], 2, "ops", "provider fixed"},
		{"retry", "effects", "email", tenants[0], 2, "ops", "provider fixed"},
	}, got)
	acts, err := a.ListActions(ctx, admin.ActionFilter{}, admin.Page{})
	require.NoError(t, err)
	require.Len(t, acts.Rows, 3)
	acts, err = a.ListActions(ctx, admin.ActionFilter{Group: retry.ID}, admin.Page{})
	require.NoError(t, err)
	require.Len(t, acts.Rows, 1)
	require.Equal(t, "retry", acts.Rows[0].Action)

	// A second retry finds nothing dead: it changes nothing and records an action
	// of 0 rows, as on plain Postgres.
	res, err = a.RetryGroup(ctx, admin.GroupAction{ID: retry.ID, Through: retry.LastSeen, Note: note})
	require.NoError(t, err)
	require.Zero(t, res.Rows)
}

// On Citus requeue, requeue of every dead effect of a kind, and forget change the
// named rows on whichever worker holds them.
func TestCitusRequeueAndForget(t *testing.T) {
	a, b, tenants := citusSetup(t)
	ctx := context.Background()

	require.NoError(t, a.Requeue(ctx, admin.EffectID{Tenant: tenants[1], Kind: "email", Key: "d0"}))
	require.Equal(t, "pending", b.effectState(t, tenants[1], "d0"))
	require.ErrorIs(t, a.Requeue(ctx, admin.EffectID{Tenant: tenants[1], Kind: "email", Key: "d0"}), admin.ErrNotDead)
	require.ErrorIs(t, a.Requeue(ctx, admin.EffectID{Tenant: tenants[1], Kind: "email", Key: "nope"}), admin.ErrNotFound)

	n, err := a.RequeueDead(ctx, effectsdb.RequeueFilter{Tenant: tenants[2]})
	require.NoError(t, err)
	require.EqualValues(t, 2, n)
	n, err = a.RequeueDead(ctx, effectsdb.RequeueFilter{Kind: "email"})
	require.NoError(t, err)
	require.EqualValues(t, 5, n, "the dead effects left, of both workers")
	require.Zero(t, b.countOf(t, `SELECT count(*) FROM effects WHERE state = 'dead'`))
	require.EqualValues(t, 12, b.countOf(t, `SELECT count(*) FROM effects WHERE state = 'pending' AND attempts = 0`))

	k, err := a.Forget(ctx, inbox.ID{Consumer: "orders", Tenant: tenants[3], Key: "f0"}, admin.Audit{Who: "ops", Why: "fixed"})
	require.NoError(t, err)
	require.Equal(t, "failed", k.State)
	require.Zero(t, b.countOf(t, `SELECT count(*) FROM inbox WHERE tenant = $1 AND key = 'f0'`, tenants[3]))
	require.Contains(t, b.logs.String(), "inbox key forgotten")
	_, err = a.Forget(ctx, inbox.ID{Consumer: "orders", Tenant: tenants[3], Key: "f0"}, admin.Audit{})
	require.ErrorIs(t, err, admin.ErrNotFound)
	b.exec(t, `INSERT INTO inbox (consumer, tenant, key, fingerprint, state, lease_until, fence, expires_at)
		VALUES ('orders', $1, 'held', '\x00', 'processing', now() + interval '1 hour', 1, now() + interval '1 day')`, tenants[0])
	_, err = a.Forget(ctx, inbox.ID{Consumer: "orders", Tenant: tenants[0], Key: "held"}, admin.Audit{})
	require.ErrorIs(t, err, admin.ErrLeaseHeld)
	require.EqualValues(t, 1, b.countOf(t, `SELECT count(*) FROM inbox WHERE tenant = $1 AND key = 'held'`, tenants[0]))
}

func (b *testBundle) effectState(t *testing.T, tenant, key string) string {
	t.Helper()
	var s string
	require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT state FROM effects WHERE tenant = $1 AND kind = 'email' AND key = $2`, tenant, key).Scan(&s))
	return s
}

// On Citus a tenant move is refused with citus_moves_tenants, naming Citus's own
// shard move, and changes nothing: Citus places tenants itself.
func TestCitusMoveTenantIsRefused(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.CitusSetup(t, pgtest.Options{MaxConns: 2})
	a, err := admin.New(admin.Config{Pool: pool, Schema: schema})
	require.NoError(t, err)
	b := &testBundle{pool: pool, schema: schema}
	b.exec(t, `INSERT INTO inbox (consumer, tenant, key, fingerprint, state, completed_at, expires_at)
		VALUES ('orders', 'acme', 'k', '\x01', 'completed', now(), now() + interval '1 day')`)
	for _, mv := range []admin.MoveTenant{{Tenant: "acme", To: "s2"}, {Tenant: "acme", From: "s1", To: "s2", DryRun: true}} {
		_, err = a.MoveTenant(context.Background(), mv)
		require.ErrorIs(t, err, admin.ErrCitusMovesTenants)
		require.Equal(t, "citus_moves_tenants", inbox.Code(err))
		require.ErrorContains(t, err, "citus_move_shard_placement")
	}
	// A shard map with a Citus shard: a move to or from it is refused, naming it.
	plain, plainSchema := pgtest.Setup(t, pgtest.Options{MaxConns: 2})
	m := &shard.Map{Shards: []shard.Shard{{Name: "plain", Pool: plain, Schema: plainSchema}, {Name: "citus", Pool: pool, Schema: schema}}}
	am, err := admin.New(admin.Config{Shards: m})
	require.NoError(t, err)
	for _, mv := range []admin.MoveTenant{{Tenant: "acme", From: "citus", To: "plain"}, {Tenant: "acme", From: "plain", To: "citus"}} {
		_, err = am.MoveTenant(context.Background(), mv)
		require.ErrorIs(t, err, admin.ErrCitusMovesTenants)
		require.ErrorContains(t, err, `shard "citus" is Citus`)
	}
	require.EqualValues(t, 1, b.countOf(t, `SELECT count(*) FROM inbox WHERE tenant = 'acme'`))
}

// On Citus operators who retry and discard the same group at once change each
// of its effects once: each ends pending or discarded, and the stored actions
// count each change once.
func TestCitusOperatorsRaceOnAGroup(t *testing.T) {
	a, b, tenants := citusSetup(t)
	ctx := context.Background()
	// 100 more dead effects of tenants[1]'s group: copies of its d0 with other keys.
	b.exec(t, `INSERT INTO effects (tenant, kind, key, fingerprint, state, attempts, error_code, last_error, error_masked, error_group, dead_at, payload)
		SELECT e.tenant, e.kind, 'x' || i, e.fingerprint, 'dead', e.attempts, e.error_code, e.last_error, e.error_masked, e.error_group, e.dead_at, e.payload
		FROM effects e, generate_series(1, 100) i WHERE e.tenant = $1 AND e.kind = 'email' AND e.key = 'd0'`, tenants[1])
	g := groupOf(t, a, admin.SourceEffects, tenants[1])
	require.EqualValues(t, 102, g.Count)
	var retried, discarded atomic.Int64
	act := func(f func(context.Context, admin.GroupAction) (*admin.ActionResult, error), into *atomic.Int64) func() {
		return func() {
			res, err := f(ctx, admin.GroupAction{ID: g.ID, Through: g.LastSeen, Note: admin.Audit{Who: "ops", Why: "race"}})
			require.NoError(t, err)
			into.Add(res.Rows)
		}
	}
	together(act(a.RetryGroup, &retried), act(a.DiscardGroup, &discarded), act(a.RetryGroup, &retried), act(a.DiscardGroup, &discarded))
	require.EqualValues(t, 102, retried.Load()+discarded.Load())
	others := `tenant = '` + tenants[1] + `' AND key <> 'p0' AND key <> 'ok0'`
	require.EqualValues(t, retried.Load(), b.countOf(t, `SELECT count(*) FROM effects WHERE state = 'pending' AND `+others))
	require.EqualValues(t, discarded.Load(), b.countOf(t, `SELECT count(*) FROM effects WHERE state = 'discarded' AND `+others))
	require.EqualValues(t, 102, b.countOf(t, `SELECT sum(affected) FROM failure_actions`))
	require.EqualValues(t, 6, b.countOf(t, `SELECT count(*) FROM effects WHERE state = 'dead'`), "the other tenants' dead effects")
}

// On Citus a failure group's action and its stored row commit together or not
// at all: with the worker that does not hold the group's tenant down, the retry
// fails (its update reads every shard, and the stored row is written on every
// node), and neither the effects nor failure_actions changed; once the worker is back the same retry
// changes the group and records it once.
func TestCitusGroupActionIsAllOrNothing(t *testing.T) {
	pool, schema, ctl := pgtest.CrashableCitus(t, pgtest.Options{MaxConns: 4})
	release := pgtest.CitusDDL(t)
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: schema, Citus: true})
	require.NoError(t, err)
	_, err = m.Up(context.Background())
	release()
	require.NoError(t, err)
	ctx := context.Background()
	a, err := admin.New(admin.Config{Pool: pool, Schema: schema})
	require.NoError(t, err)
	b := &testBundle{pool: pool, schema: schema}
	w1, _ := pgtest.CitusTenants(t, pool, schema, "t", 1)
	sctx := effects.WithScope(ctx, effects.Scope{Schema: schema, Tenant: w1[0]})
	for i := range 3 {
		_, err := effects.Enqueue(sctx, pool, effects.Effect{Kind: "email", Key: fmt.Sprintf("d%d", i), Payload: []byte(`{}`)})
		require.NoError(t, err)
	}
	b.dispatchUntil(t, map[string]effects.Sender{"email": effects.SenderFunc(func(context.Context, effects.Delivery) error {
		return effects.Permanent(&codedErr{code: "rejected", msg: "provider rejected"})
	})}, `SELECT count(*) = 3 FROM effects WHERE state = 'dead'`)
	g := groupOf(t, a, admin.SourceEffects, w1[0])
	act := admin.GroupAction{ID: g.ID, Through: g.LastSeen, Note: admin.Audit{Who: "ops", Why: "fixed"}}

	ctl.CrashWorker(2)
	_, err = a.RetryGroup(ctx, act)
	require.Error(t, err)
	ctl.StartWorker(2)
	require.EqualValues(t, 3, b.countOf(t, `SELECT count(*) FROM effects WHERE state = 'dead'`))
	require.Zero(t, b.countOf(t, `SELECT count(*) FROM failure_actions`))

	res, err := a.RetryGroup(ctx, act)
	require.NoError(t, err)
	require.EqualValues(t, 3, res.Rows)
	require.EqualValues(t, 3, b.countOf(t, `SELECT count(*) FROM effects WHERE state = 'pending' AND attempts = 0`))
	require.EqualValues(t, 1, b.countOf(t, `SELECT count(*) FROM failure_actions WHERE action = 'retry' AND affected = 3`))
}

// On Citus failures recorded without their group (before migration 006) are
// grouped by the first list, on both workers.
func TestCitusBackfillGroupsOldFailures(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.CitusSetup(t, pgtest.Options{MaxConns: 2})
	a, err := admin.New(admin.Config{Pool: pool, Schema: schema})
	require.NoError(t, err)
	b := &testBundle{pool: pool, schema: schema}
	w1, w2 := pgtest.CitusTenants(t, pool, schema, "t", 1)
	for _, tenant := range []string{w1[0], w2[0]} {
		b.exec(t, `INSERT INTO inbox (consumer, tenant, key, fingerprint, state, error_code, error, completed_at, expires_at)
			SELECT 'orders', $1, 'f' || i, '\x01', 'failed', 'bad', 'order ' || i || ' is bad', now(), now() + interval '1 day'
			FROM generate_series(1, 3) i`, tenant)
		b.exec(t, `INSERT INTO effects (tenant, kind, key, fingerprint, state, error_code, last_error, next_attempt_at, payload)
			SELECT $1, 'email', 'd' || i, '\x01', 'dead', 'rejected', 'mail ' || i || ' rejected', now(), '{}'
			FROM generate_series(1, 2) i`, tenant)
	}
	groups := groupsOf(t, a, admin.GroupFilter{})
	require.Len(t, groups, 4)
	for _, g := range groups {
		require.EqualValues(t, map[string]int64{admin.SourceInbox: 3, admin.SourceEffects: 2}[g.Source], g.Count)
	}
	require.Zero(t, b.countOf(t, `SELECT count(*) FROM inbox WHERE error_group IS NULL`))
	require.Zero(t, b.countOf(t, `SELECT count(*) FROM effects WHERE error_group IS NULL OR dead_at IS NULL`))
}
