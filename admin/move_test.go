package admin_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/shard"
)

// moveRig is one tenant's consumer and dispatcher over a shard map.
type moveRig struct {
	t      *testing.T
	runs   atomic.Int64
	mu     sync.Mutex
	sent   map[string]int
	tenant string
	// hooks: the handler enqueues a webhook effect ("hook:" and the message ID)
	// besides its email.
	hooks bool
}

// consumer returns a function that delivers one message of the tenant through a
// consumer over m. A message whose ID starts with "bad" fails permanently (a
// failed inbox key); the others enqueue their effects.
func (r *moveRig) consumer(m *shard.Map) func(key string) {
	c, err := consumer.New(consumer.Config{Name: "orders", Shards: m, Tenant: consumer.MetadataKey("tenant"),
		Registerer: prometheus.NewRegistry()})
	require.NoError(r.t, err)
	r.t.Cleanup(func() { _ = c.Close() })
	h := c.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		r.runs.Add(1)
		if strings.HasPrefix(msg.UUID, "bad") {
			return nil, consumer.Permanent(fmt.Errorf("order %s refused", msg.UUID))
		}
		ctx := msg.Context()
		if _, err := effects.Enqueue(ctx, consumer.Tx(ctx), effects.Effect{Kind: "email", Key: "mail:" + msg.UUID, Payload: msg.Payload}); err != nil {
			return nil, err
		}
		if !r.hooks {
			return nil, nil
		}
		_, err := effects.Enqueue(ctx, consumer.Tx(ctx), effects.Effect{Kind: "webhook", Key: "hook:" + msg.UUID, Payload: msg.Payload})
		return nil, err
	})
	return func(key string) {
		msg := message.NewMessage(key, []byte(key))
		msg.Metadata.Set("tenant", r.tenant)
		_, err := h(msg)
		require.NoError(r.t, err)
	}
}

// dispatch runs a Dispatcher over m until every effect of the tenant on every
// shard is done, and returns the sends per key.
func (r *moveRig) dispatch(m *shard.Map, wantSends int) map[string]int {
	return r.dispatchKinds(m, wantSends, "email")
}

// dispatchKinds is dispatch with a sender that succeeds for each of kinds.
func (r *moveRig) dispatchKinds(m *shard.Map, wantSends int, kinds ...string) map[string]int {
	r.sent = map[string]int{}
	senders := map[string]effects.Sender{}
	for _, kind := range kinds {
		senders[kind] = effects.SenderFunc(func(_ context.Context, d effects.Delivery) error {
			r.mu.Lock()
			r.sent[d.Key]++
			r.mu.Unlock()
			return nil
		})
	}
	d, err := effects.NewDispatcher(effects.Config{Shards: m, PollInterval: 50 * time.Millisecond, Registerer: prometheus.NewRegistry(),
		Senders: senders})
	require.NoError(r.t, err)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { _ = d.Run(ctx) })
	defer func() { cancel(); wg.Wait() }()
	require.Eventually(r.t, func() bool {
		pending := 0
		for _, s := range m.Shards {
			pending += pgtest.ShardCount(r.t, s, `SELECT count(*) FROM effects WHERE state = 'pending'`)
		}
		r.mu.Lock()
		defer r.mu.Unlock()
		total := 0
		for _, n := range r.sent {
			total += n
		}
		return pending == 0 && total >= wantSends
	}, 20*time.Second, 20*time.Millisecond)
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.sent
}

// killHooks runs a Dispatcher over m whose webhook sender fails permanently
// until n webhook effects of the tenant are dead on shard s.
func (r *moveRig) killHooks(m *shard.Map, s shard.Shard, n int) {
	d, err := effects.NewDispatcher(effects.Config{Shards: m, PollInterval: 20 * time.Millisecond, Registerer: prometheus.NewRegistry(),
		Senders: map[string]effects.Sender{"webhook": effects.SenderFunc(func(_ context.Context, d effects.Delivery) error {
			return effects.Permanent(fmt.Errorf("endpoint refused %s", d.Key))
		})}})
	require.NoError(r.t, err)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { _ = d.Run(ctx) })
	defer func() { cancel(); wg.Wait() }()
	require.Eventually(r.t, func() bool {
		return pgtest.ShardCount(r.t, s, `SELECT count(*) FROM effects WHERE kind = 'webhook' AND state = 'dead'`) == n
	}, 20*time.Second, 20*time.Millisecond)
}

// tenantRows counts the tenant's inbox keys and effects on s.
func (r *moveRig) tenantRows(s shard.Shard) (inboxKeys, effectRows int) {
	return pgtest.ShardCount(r.t, s, `SELECT count(*) FROM inbox WHERE tenant = '`+r.tenant+`'`),
		pgtest.ShardCount(r.t, s, `SELECT count(*) FROM effects WHERE tenant = '`+r.tenant+`'`)
}

// TestMoveTenant moves a tenant's rows between two of the 3 shard clusters: the
// tenant's messages were handled on its old shard (effects still pending), it is
// drained, copied (or not), its route switched with a Table entry, and its
// messages redelivered. With the copy, every redelivery is a duplicate and every
// effect is sent once, from the new shard. Without it, the documented hazard: the
// redeliveries run the handler again, and each effect is sent twice (once from
// each shard).
func TestMoveTenant(t *testing.T) {
	for _, copyRows := range []bool{true, false} {
		t.Run(fmt.Sprintf("copy=%v", copyRows), func(t *testing.T) {
			t.Parallel()
			m := pgtest.Shards(t)
			ctx := context.Background()
			r := &moveRig{t: t, tenant: "acme"}
			old, to := r.shards(m)
			deliver := r.consumer(m)
			keys := []string{"k1", "k2", "k3", "k4", "k5"}
			for _, k := range keys {
				deliver(k)
			}
			require.EqualValues(t, 5, r.runs.Load())

			a, err := admin.New(admin.Config{Shards: m})
			require.NoError(t, err)
			plan, err := a.MoveTenant(ctx, admin.MoveTenant{Tenant: r.tenant, To: to, DryRun: true})
			require.NoError(t, err)
			require.Equal(t, old.Name, plan.From)
			require.Equal(t, map[string]int64{"completed": 5}, plan.InboxKeys)
			require.Equal(t, map[string]int64{"pending": 5}, plan.Effects)
			require.Zero(t, plan.Busy)
			require.Zero(t, plan.InboxCopied)

			if copyRows {
				res, err := a.MoveTenant(ctx, admin.MoveTenant{Tenant: r.tenant, To: to})
				require.NoError(t, err)
				require.EqualValues(t, 5, res.InboxCopied)
				require.EqualValues(t, 5, res.EffectsCopied)
				require.EqualValues(t, 5, res.HandedOver)
				require.EqualValues(t, 5, res.InboxDeleted)
				require.EqualValues(t, 5, res.EffectsDeleted)
				keys, effs := r.tenantRows(old)
				require.Zero(t, keys+effs, "no row of the tenant left on its old shard")
				// Again: nothing new, nothing lost.
				res, err = a.MoveTenant(ctx, admin.MoveTenant{Tenant: r.tenant, From: old.Name, To: to})
				require.NoError(t, err)
				require.Zero(t, res.InboxCopied+res.EffectsCopied+res.HandedOver+res.InboxDeleted+res.EffectsDeleted)
			}

			// Switch the route, resume, redeliver.
			moved := &shard.Map{Shards: m.Shards, Table: map[string]string{r.tenant: to}}
			deliver = r.consumer(moved)
			for _, k := range keys {
				deliver(k)
			}
			newShard := m.Shards[slicesIndex(m, to)]
			if copyRows {
				require.EqualValues(t, 5, r.runs.Load(), "the redeliveries are duplicates on the new shard")
				require.Zero(t, pgtest.ShardCount(t, old, `SELECT count(*) FROM effects WHERE state = 'pending'`))
				sent := r.dispatch(moved, 5)
				require.Len(t, sent, 5)
				for k, n := range sent {
					require.Equal(t, 1, n, "effect %s sent once", k)
				}
				require.Equal(t, 5, pgtest.ShardCount(t, newShard, `SELECT count(*) FROM effects WHERE state = 'done'`))
				return
			}
			require.EqualValues(t, 10, r.runs.Load(), "without the copy the redeliveries run the handler again")
			sent := r.dispatch(moved, 10)
			require.Len(t, sent, 5)
			for k, n := range sent {
				require.Equal(t, 2, n, "effect %s sent from both shards", k)
			}
		})
	}
}

// TestMoveTenantCrash kills the process that moves a tenant (SIGKILL) right after
// each step of the move has committed, the tenant having pending effects (email),
// dead ones (webhook) and failed inbox keys. At every such point no effect is due
// on two shards and none is lost, and no failure can be repaired twice: a retry of
// the dead group or a release of the failed one either plans each row once, on one
// shard, or is refused (off_route) because some are on the new shard already.
// Running the move again finishes it: nothing of the tenant is left on the old
// shard, the redeliveries after the route switch are duplicates, and every
// effect, the retried dead ones included, is sent once.
func TestMoveTenantCrash(t *testing.T) {
	for _, step := range []string{"parked", "inbox_inserted", "inbox_moved", "effects_inserted", "effects_moved", "handed_back"} {
		t.Run(step, func(t *testing.T) {
			t.Parallel()
			m := pgtest.Shards(t)
			ctx := context.Background()
			r := &moveRig{t: t, tenant: "acme", hooks: true}
			old, to := r.shards(m)
			deliver := r.consumer(m)
			keys := []string{"k1", "k2", "k3", "k4", "k5"}
			for _, k := range append(keys, "bad1", "bad2") {
				deliver(k)
			}
			r.killHooks(m, old, 5)

			child := childproc.Start(t, roleMove, childproc.Options{Params: childproc.Params{
				"schema": old.Schema, "tenant": r.tenant, "from": old.Name, "to": to, "die_at": step}})
			child.Wait(t, time.Minute)
			require.True(t, child.Killed(), "the mover must die at %s:\n%s", step, child.Output())

			// Every effect is on some shard, none is due on two, and the ones
			// still pending are all there.
			due, pending, all := map[string]int{}, map[string]bool{}, map[string]bool{}
			for _, s := range m.Shards {
				rows, err := s.Pool.Query(ctx, `SELECT key, state, state = 'pending' AND next_attempt_at <= now() FROM effects
					WHERE tenant = $1`, r.tenant)
				require.NoError(t, err)
				for rows.Next() {
					var key, state string
					var isDue bool
					require.NoError(t, rows.Scan(&key, &state, &isDue))
					all[key] = true
					if state == "pending" {
						pending[key] = true
					}
					if isDue {
						due[key]++
					}
				}
				require.NoError(t, rows.Err())
			}
			require.Len(t, all, 10, "an effect was lost")
			require.Len(t, pending, 5, "a pending effect was lost")
			for k, n := range due {
				require.Equal(t, 1, n, "effect %s is due on %d shards", k, n)
			}
			a, err := admin.New(admin.Config{Shards: m})
			require.NoError(t, err)
			for _, source := range []string{admin.SourceEffects, admin.SourceInbox} {
				gs, err := a.ListGroups(ctx, admin.GroupFilter{Source: source}, admin.Page{})
				require.NoError(t, err)
				require.Len(t, gs.Rows, 1)
				g := gs.Rows[0]
				act := a.RetryGroup
				if source == admin.SourceInbox {
					act = a.ReleaseGroup
				}
				plan, err := act(ctx, admin.GroupAction{ID: g.ID, Through: g.LastSeen, DryRun: true})
				if errors.Is(err, admin.ErrOffRoute) {
					continue
				}
				require.NoError(t, err)
				require.Equal(t, map[string]int64{old.Name: g.Count}, plan.Shards, "a %s group's rows are planned on the old shard alone", source)
			}

			_, err = a.MoveTenant(ctx, admin.MoveTenant{Tenant: r.tenant, From: old.Name, To: to})
			require.NoError(t, err, "the move again, after the crash")
			keysLeft, effectsLeft := r.tenantRows(old)
			require.Zero(t, keysLeft+effectsLeft, "no row of the tenant left on its old shard")
			newShard := m.Shards[slicesIndex(m, to)]
			require.Equal(t, 5, pgtest.ShardCount(t, newShard, `SELECT count(*) FROM effects WHERE state = 'dead'`))
			require.Equal(t, 2, pgtest.ShardCount(t, newShard, `SELECT count(*) FROM inbox WHERE state = 'failed'`))

			moved := &shard.Map{Shards: m.Shards, Table: map[string]string{r.tenant: to}}
			deliver = r.consumer(moved)
			for _, k := range keys {
				deliver(k)
			}
			require.EqualValues(t, 7, r.runs.Load(), "the redeliveries are duplicates on the new shard")
			am, err := admin.New(admin.Config{Shards: moved})
			require.NoError(t, err)
			gs, err := am.ListGroups(ctx, admin.GroupFilter{Source: admin.SourceEffects}, admin.Page{})
			require.NoError(t, err)
			require.Len(t, gs.Rows, 1)
			res, err := am.RetryGroup(ctx, admin.GroupAction{ID: gs.Rows[0].ID, Through: gs.Rows[0].LastSeen, Note: admin.Audit{Who: "op", Why: "after the move"}})
			require.NoError(t, err)
			require.Equal(t, map[string]int64{to: 5}, res.Shards)
			sent := r.dispatchKinds(moved, 10, "email", "webhook")
			require.Len(t, sent, 10)
			for k, n := range sent {
				require.Equal(t, 1, n, "effect %s sent once", k)
			}
		})
	}
}

// shards returns the tenant's shard on m and another shard to move it to.
func (r *moveRig) shards(m *shard.Map) (old shard.Shard, to string) {
	old, err := m.Pick(r.tenant)
	require.NoError(r.t, err)
	for _, s := range m.Shards {
		if s.Name != old.Name {
			return old, s.Name
		}
	}
	r.t.Fatal("the map has one shard")
	return old, ""
}

func slicesIndex(m *shard.Map, name string) int {
	for i, s := range m.Shards {
		if s.Name == name {
			return i
		}
	}
	return -1
}

// TestMoveTenantRefusesBusy: an inbox key processing under a running lease, or an
// effect being sent, keeps the tenant from moving; nothing changes on either shard.
func TestMoveTenantRefusesBusy(t *testing.T) {
	t.Parallel()
	m := pgtest.Shards(t)
	ctx := context.Background()
	old, _ := m.Pick("busy")
	to := m.Shards[(slicesIndex(m, old.Name)+1)%len(m.Shards)]
	_, err := old.Pool.Exec(ctx, `INSERT INTO effects (tenant, kind, key, fingerprint, in_flight, next_attempt_at) VALUES
		('busy', 'email', 'sending', '\x00', true, now() + interval '1 minute'),
		('busy', 'email', 'waiting', '\x00', false, now())`)
	require.NoError(t, err)
	a, err := admin.New(admin.Config{Shards: m})
	require.NoError(t, err)
	res, err := a.MoveTenant(ctx, admin.MoveTenant{Tenant: "busy", To: to.Name})
	require.ErrorIs(t, err, admin.ErrNotDrained)
	require.EqualValues(t, 1, res.Busy)
	require.Zero(t, pgtest.ShardCount(t, to, `SELECT count(*) FROM effects`))
	require.Equal(t, 1, pgtest.ShardCount(t, old, `SELECT count(*) FROM effects WHERE key = 'waiting' AND next_attempt_at <= now()`), "not parked")

	_, err = a.MoveTenant(ctx, admin.MoveTenant{Tenant: "busy", To: "nope"})
	require.ErrorIs(t, err, admin.ErrBadFilter)
	_, err = a.MoveTenant(ctx, admin.MoveTenant{Tenant: "busy", From: old.Name, To: old.Name})
	require.ErrorIs(t, err, admin.ErrBadFilter)
}

// TestMoveTenantUnstorableTenant: a tenant that Postgres text cannot hold
// (invalid UTF-8, a NUL byte) has no rows on any shard; moving it is bad_filter,
// and neither shard is read or changed.
func TestMoveTenantUnstorableTenant(t *testing.T) {
	t.Parallel()
	m := pgtest.Shards(t)
	a, err := admin.New(admin.Config{Shards: m})
	require.NoError(t, err)
	for _, tenant := range []string{"ac\x00me", "ac\xffme"} {
		for _, dry := range []bool{true, false} {
			_, err := a.MoveTenant(context.Background(), admin.MoveTenant{Tenant: tenant, From: m.Shards[0].Name, To: m.Shards[1].Name, DryRun: dry})
			require.ErrorIs(t, err, admin.ErrBadFilter, "tenant %q, dry run %v", tenant, dry)
		}
	}
}

// TestMoveTenantDeadEffectsOnce is a moved tenant's failures repaired once: the
// tenant "movee" on s1 has 30 dead webhook effects and 3 failed inbox keys; after
// MoveTenant to s3 and the route switched, s1 holds no row of it, the groups list
// shows 30 and 3 on s3 alone, a retry requeues 30 and a release 3, all on s3, one
// key's requeue takes 1, and a Dispatcher that now succeeds sends each effect
// once.
func TestMoveTenantDeadEffectsOnce(t *testing.T) {
	t.Parallel()
	m := pgtest.Shards(t)
	ctx := context.Background()
	s1, s3 := m.Shards[0], m.Shards[2]
	before := &shard.Map{Shards: m.Shards, Table: map[string]string{"movee": s1.Name}}
	r := &moveRig{t: t, tenant: "movee", hooks: true}
	deliver := r.consumer(before)
	for i := range 30 {
		deliver(fmt.Sprintf("m%02d", i))
	}
	for i := range 3 {
		deliver(fmt.Sprintf("bad%d", i))
	}
	r.killHooks(before, s1, 30)
	r.dispatch(before, 30) // the emails are sent before the move

	a, err := admin.New(admin.Config{Shards: before})
	require.NoError(t, err)
	res, err := a.MoveTenant(ctx, admin.MoveTenant{Tenant: "movee", To: s3.Name})
	require.NoError(t, err)
	require.Equal(t, s1.Name, res.From)
	require.EqualValues(t, 60, res.EffectsCopied, "30 dead webhooks and 30 done emails")
	require.EqualValues(t, 33, res.InboxCopied)
	require.EqualValues(t, 60, res.EffectsDeleted)
	require.EqualValues(t, 33, res.InboxDeleted)
	keys, effs := r.tenantRows(s1)
	require.Zero(t, keys+effs, "s1 holds no row of the moved tenant")
	require.Equal(t, 30, pgtest.ShardCount(t, s3, `SELECT count(*) FROM effects WHERE tenant = 'movee' AND kind = 'webhook' AND state = 'dead'`))
	require.Equal(t, 3, pgtest.ShardCount(t, s3, `SELECT count(*) FROM inbox WHERE tenant = 'movee' AND state = 'failed'`))

	after := &shard.Map{Shards: m.Shards, Table: map[string]string{"movee": s3.Name}}
	a, err = admin.New(admin.Config{Shards: after})
	require.NoError(t, err)
	want := map[string]int64{admin.SourceEffects: 30, admin.SourceInbox: 3}
	for _, source := range []string{admin.SourceEffects, admin.SourceInbox} {
		gs, err := a.ListGroups(ctx, admin.GroupFilter{Source: source}, admin.Page{})
		require.NoError(t, err)
		require.Len(t, gs.Rows, 1, source)
		g := gs.Rows[0]
		require.EqualValues(t, want[source], g.Count, source)
		require.Equal(t, s3.Name, g.Shard, source)
		act := a.RetryGroup
		if source == admin.SourceInbox {
			act = a.ReleaseGroup
		}
		if source == admin.SourceEffects {
			// One key first: requeued once, on s3.
			n, err := a.RequeueDead(ctx, effectsdb.RequeueFilter{Kind: "webhook", Tenant: "movee", TenantExact: true, Key: "hook:m07"})
			require.NoError(t, err)
			require.EqualValues(t, 1, n)
			want[source]--
		}
		out, err := act(ctx, admin.GroupAction{ID: g.ID, Through: g.LastSeen, Note: admin.Audit{Who: "op", Why: "fixed"}})
		require.NoError(t, err)
		require.Equal(t, want[source], out.Rows, source)
		require.Equal(t, map[string]int64{s3.Name: want[source]}, out.Shards, source)
	}
	require.Zero(t, pgtest.ShardCount(t, s3, `SELECT count(*) FROM inbox WHERE state = 'failed'`))

	sent := r.dispatchKinds(after, 30, "webhook")
	require.Len(t, sent, 30)
	for k, n := range sent {
		require.Equal(t, 1, n, "effect %s sent once", k)
	}
	require.Equal(t, 30, pgtest.ShardCount(t, s3, `SELECT count(*) FROM effects WHERE kind = 'webhook' AND state = 'done'`))
	require.Zero(t, pgtest.ShardCount(t, s1, `SELECT count(*) FROM effects`))
}

// TestShardsActionsRefuseOffRoute: rows of a tenant on a shard its route does not
// name (left by a move that is not finished, or by a route changed without one)
// are touched by no action: a failure group's retry, discard and release (dry run
// or not), one key's requeue, a requeue by filter and a forget are refused with
// off_route, naming the shards and the move to run, and no row changes on any
// shard. Finishing the move makes them act, once.
func TestShardsActionsRefuseOffRoute(t *testing.T) {
	t.Parallel()
	m := pgtest.Shards(t)
	ctx := context.Background()
	routed, err := m.Pick("acme")
	require.NoError(t, err)
	other := m.Shards[(slicesIndex(m, routed.Name)+1)%len(m.Shards)]
	at := time.Now().Add(-time.Minute).UTC().Truncate(time.Second)
	for _, s := range []shard.Shard{routed, other} {
		_, err := s.Pool.Exec(ctx, `INSERT INTO effects (tenant, kind, key, fingerprint, state, attempts,
				last_error, error_code, error_masked, error_group, dead_at)
			SELECT 'acme', 'webhook', 'k' || g, '\x00', 'dead', 3, 'refused', 'provider', 'refused', '\x0102030405060708', $1
			FROM generate_series(1, 3) g`, at)
		require.NoError(t, err)
		failOnCode(t, s, "acme", "handler", "f", 2, at)
	}
	snapshot := func() string {
		var out []string
		for _, s := range m.Shards {
			var x string
			require.NoError(t, s.Pool.QueryRow(ctx, `SELECT coalesce((SELECT string_agg(key || state, ',' ORDER BY key) FROM effects), '')
				|| '|' || coalesce((SELECT string_agg(key || state, ',' ORDER BY key) FROM inbox), '')`).Scan(&x))
			out = append(out, x)
		}
		return strings.Join(out, ";")
	}
	was := snapshot()
	a, err := admin.New(admin.Config{Shards: m})
	require.NoError(t, err)
	note := admin.Audit{Who: "op", Why: "test"}
	groups, err := a.ListGroups(ctx, admin.GroupFilter{}, admin.Page{})
	require.NoError(t, err)
	require.Len(t, groups.Rows, 2)
	for _, g := range groups.Rows {
		require.EqualValues(t, map[string]int64{admin.SourceEffects: 6, admin.SourceInbox: 4}[g.Source], g.Count, "the list shows both shards' rows")
		acts := map[string]func(context.Context, admin.GroupAction) (*admin.ActionResult, error){
			"retry": a.RetryGroup, "discard": a.DiscardGroup}
		if g.Source == admin.SourceInbox {
			acts = map[string]func(context.Context, admin.GroupAction) (*admin.ActionResult, error){"release": a.ReleaseGroup}
		}
		for name, act := range acts {
			for _, dry := range []bool{true, false} {
				_, err := act(ctx, admin.GroupAction{ID: g.ID, Through: g.LastSeen, DryRun: dry, Note: note})
				require.ErrorIs(t, err, admin.ErrOffRoute, "%s, dry run %v", name, dry)
				require.Contains(t, err.Error(), "--from "+other.Name+" --to "+routed.Name)
			}
		}
	}
	err = a.Requeue(ctx, admin.EffectID{Tenant: "acme", Kind: "webhook", Key: "k1"})
	require.ErrorIs(t, err, admin.ErrOffRoute)
	_, err = a.RequeueDead(ctx, effectsdb.RequeueFilter{Kind: "webhook", All: true})
	require.ErrorIs(t, err, admin.ErrOffRoute)
	_, err = a.Forget(ctx, inbox.ID{Consumer: "orders", Tenant: "acme", Key: "f-1"}, note)
	require.ErrorIs(t, err, admin.ErrOffRoute)
	require.Equal(t, was, snapshot(), "no row changed on any shard")

	// Finish the move (the rows on the routed shard are kept): then each acts once.
	_, err = a.MoveTenant(ctx, admin.MoveTenant{Tenant: "acme", From: other.Name, To: routed.Name})
	require.NoError(t, err)
	n, err := a.RequeueDead(ctx, effectsdb.RequeueFilter{Kind: "webhook", All: true})
	require.NoError(t, err)
	require.EqualValues(t, 3, n)
	require.Equal(t, 3, pgtest.ShardCount(t, routed, `SELECT count(*) FROM effects WHERE state = 'pending'`))
	require.Zero(t, pgtest.ShardCount(t, other, `SELECT count(*) FROM effects`))
}
