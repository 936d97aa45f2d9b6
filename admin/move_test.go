package admin_test

import (
	"context"
	"fmt"
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
	"github.com/idemkit/idem/internal/childproc"
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
}

func (r *moveRig) consumer(m *shard.Map) func(key string) {
	c, err := consumer.New(consumer.Config{Name: "orders", Shards: m, Tenant: consumer.MetadataTenant("tenant"),
		Registerer: prometheus.NewRegistry()})
	require.NoError(r.t, err)
	r.t.Cleanup(func() { _ = c.Close() })
	h := c.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		r.runs.Add(1)
		ctx := msg.Context()
		_, err := effects.Enqueue(ctx, consumer.Tx(ctx), effects.Effect{Kind: "email", Key: "mail:" + msg.UUID, Payload: msg.Payload})
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
	r.sent = map[string]int{}
	d, err := effects.NewDispatcher(effects.Config{Shards: m, PollInterval: 50 * time.Millisecond, Registerer: prometheus.NewRegistry(),
		Senders: map[string]effects.Sender{"email": effects.SenderFunc(func(_ context.Context, d effects.Delivery) error {
			r.mu.Lock()
			r.sent[d.Key]++
			r.mu.Unlock()
			return nil
		})}})
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
				// Again: nothing new, nothing lost.
				res, err = a.MoveTenant(ctx, admin.MoveTenant{Tenant: r.tenant, From: old.Name, To: to})
				require.NoError(t, err)
				require.Zero(t, res.InboxCopied+res.EffectsCopied+res.HandedOver)
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
// each step of the move has committed. At every such point no effect is due on
// both shards and none is lost; running the move again finishes it: the
// redeliveries after the route switch are duplicates and every effect is sent
// once.
func TestMoveTenantCrash(t *testing.T) {
	for _, step := range []string{"parked", "inbox_copied", "effects_copied", "handed_back"} {
		t.Run(step, func(t *testing.T) {
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

			child := childproc.Start(t, roleMove, childproc.Options{Params: childproc.Params{
				"schema": old.Schema, "tenant": r.tenant, "from": old.Name, "to": to, "die_at": step}})
			child.Wait(t, time.Minute)
			require.True(t, child.Killed(), "the mover must die at %s:\n%s", step, child.Output())

			// Every effect is pending on some shard, and none is due on two.
			due, pending := map[string]int{}, map[string]bool{}
			for _, s := range m.Shards {
				rows, err := s.Pool.Query(ctx, `SELECT key, next_attempt_at <= now() FROM effects
					WHERE tenant = $1 AND state = 'pending'`, r.tenant)
				require.NoError(t, err)
				for rows.Next() {
					var key string
					var isDue bool
					require.NoError(t, rows.Scan(&key, &isDue))
					pending[key] = true
					if isDue {
						due[key]++
					}
				}
				require.NoError(t, rows.Err())
			}
			require.Len(t, pending, 5, "an effect was lost")
			for k, n := range due {
				require.Equal(t, 1, n, "effect %s is due on %d shards", k, n)
			}

			a, err := admin.New(admin.Config{Shards: m})
			require.NoError(t, err)
			_, err = a.MoveTenant(ctx, admin.MoveTenant{Tenant: r.tenant, From: old.Name, To: to})
			require.NoError(t, err, "the move again, after the crash")
			require.Zero(t, pgtest.ShardCount(t, old, `SELECT count(*) FROM effects WHERE state = 'pending'`))

			moved := &shard.Map{Shards: m.Shards, Table: map[string]string{r.tenant: to}}
			deliver = r.consumer(moved)
			for _, k := range keys {
				deliver(k)
			}
			require.EqualValues(t, 5, r.runs.Load(), "the redeliveries are duplicates on the new shard")
			sent := r.dispatch(moved, 5)
			require.Len(t, sent, 5)
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
