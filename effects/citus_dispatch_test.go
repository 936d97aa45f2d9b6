package effects_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/migrate"
)

// effectStmts counts the statements on the effects table that a pool sends,
// and the claims that claimed nothing.
type effectStmts struct {
	mu          sync.Mutex
	n, claims   int
	emptyClaims int
}

func (tr *effectStmts) count(sql, tag string) {
	if !strings.Contains(sql, `"effects"`) {
		return
	}
	tr.mu.Lock()
	defer tr.mu.Unlock()
	tr.n++
	if strings.HasPrefix(strings.TrimSpace(sql), "WITH want AS") {
		tr.claims++
		if tag == "UPDATE 0" {
			tr.emptyClaims++
		}
	}
}

func (tr *effectStmts) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	tr.count(d.SQL, "")
	return ctx
}
func (tr *effectStmts) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (tr *effectStmts) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}
func (tr *effectStmts) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	tr.count(d.SQL, d.CommandTag.String())
}
func (tr *effectStmts) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// enqueueFor enqueues effects of kind with keys for tenant, each in a transaction
// of its own.
func enqueueFor(t *testing.T, pool *pgxpool.Pool, schema, tenant, kind string, delay time.Duration, keys ...string) {
	t.Helper()
	ctx := effects.WithScope(context.Background(), effects.Scope{Schema: schema, Tenant: tenant})
	for _, key := range keys {
		_, err := effects.Enqueue(ctx, pool, effects.Effect{Kind: kind, Key: key, Delay: delay})
		require.NoError(t, err)
	}
}

// sends records every send, by tenant/kind/key.
type sends struct {
	mu sync.Mutex
	n  map[string]int
}

func (s *sends) sender() effects.Sender {
	return effects.SenderFunc(func(_ context.Context, d effects.Delivery) error {
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.n == nil {
			s.n = map[string]int{}
		}
		s.n[d.Tenant+"/"+d.Kind+"/"+d.Key]++
		return nil
	})
}

func (s *sends) get() map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[string]int{}
	for k, v := range s.n {
		out[k] = v
	}
	return out
}

func runDispatcher(t *testing.T, cfg effects.Config) {
	t.Helper()
	d, err := effects.NewDispatcher(cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	t.Cleanup(func() { cancel(); require.NoError(t, <-done) })
}

// On Citus a Dispatcher without a Tenant drains the effects of every tenant,
// on both workers, each sent once and recorded done, from a schema where most
// tenants have nothing due: one read finds the tenants with due work and each of
// those is claimed on its own shard, so no claim is of a tenant with nothing due
// and the statements on effects stay below two per effect drained (a poll of every
// tenant would cost more than that in one round). Polling is an hour apart: the
// start and LISTEN wake-ups drive it.
func TestCitusDispatcherDrainsEveryTenant(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.CitusSetup(t, pgtest.Options{MaxConns: 8})
	for i := range 150 {
		enqueueFor(t, pool, schema, fmt.Sprintf("idle-%d", i), "mail", time.Hour, "later")
	}
	w1, w2 := pgtest.CitusTenants(t, pool, schema, "busy-", 3)
	busy := slices.Concat(w1, w2)
	const perTenant = 10
	want := map[string]int{}
	for _, tenant := range busy {
		for i := range perTenant {
			kind := []string{"mail", "sms"}[i%2]
			key := fmt.Sprint("k", i)
			enqueueFor(t, pool, schema, tenant, kind, 0, key)
			want[tenant+"/"+kind+"/"+key] = 1
		}
	}

	tr := &effectStmts{}
	cfg := pool.Config().Copy()
	cfg.ConnConfig.Tracer = tr
	traced, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(traced.Close)
	var s sends
	runDispatcher(t, effects.Config{Pool: traced, Schema: schema, PollInterval: time.Hour,
		Senders: map[string]effects.Sender{"mail": s.sender(), "sms": s.sender()}, Registerer: prometheus.NewRegistry()})
	pgtest.WaitFor(t, 60*time.Second, "every busy tenant's effects done", func() bool {
		return pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE state = 'done' AND attempts = 1 AND fence = 1 AND recorded_fence = 1`) == len(want)
	})
	require.Equal(t, want, s.get(), "each effect sent once")
	require.Equal(t, 150, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE tenant LIKE 'idle-%' AND state = 'pending' AND fence = 0`))

	tr.mu.Lock()
	defer tr.mu.Unlock()
	require.Zero(t, tr.emptyClaims, "a claim of a tenant with nothing due")
	require.LessOrEqual(t, tr.claims, len(busy)*2, "claims: one per busy tenant and round")
	require.Less(t, tr.n, 2*len(want), "statements on effects per effect drained")
}

// On Citus, an effect enqueued for a tenant of either worker wakes a Dispatcher
// without a Tenant through its LISTEN on the coordinator: polling is an hour
// apart, and the effect is sent within seconds.
func TestCitusDispatcherWakesOnEnqueueForEitherWorker(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.CitusSetup(t, pgtest.Options{MaxConns: 6})
	w1, w2 := pgtest.CitusTenants(t, pool, schema, "busy-", 1)
	var s sends
	runDispatcher(t, effects.Config{Pool: pool, Schema: schema, PollInterval: time.Hour,
		Senders: map[string]effects.Sender{"mail": s.sender()}, Registerer: prometheus.NewRegistry()})
	pgtest.WaitFor(t, 30*time.Second, "LISTEN connection up", func() bool { return listenerUp(t, pool, schema) })
	for _, tenant := range []string{w1[0], w2[0]} {
		enqueueFor(t, pool, schema, tenant, "mail", 0, "woken")
		pgtest.WaitFor(t, 20*time.Second, "the effect of "+tenant+" sent", func() bool {
			return pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE tenant = $1 AND state = 'done'`, tenant) == 1
		})
	}
	require.Equal(t, map[string]int{w1[0] + "/mail/woken": 1, w2[0] + "/mail/woken": 1}, s.get())
}

// On Citus two Dispatchers without a Tenant drain the same tenants side by side:
// every effect is sent once, by one of them, and recorded with its only fence.
func TestCitusTwoDispatchersSendEachEffectOnce(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.CitusSetup(t, pgtest.Options{MaxConns: 10})
	w1, w2 := pgtest.CitusTenants(t, pool, schema, "busy-", 3)
	want := map[string]int{}
	for _, tenant := range slices.Concat(w1, w2) {
		for i := range 20 {
			key := fmt.Sprint("k", i)
			enqueueFor(t, pool, schema, tenant, "mail", 0, key)
			want[tenant+"/mail/"+key] = 1
		}
	}
	var s sends
	for range 2 {
		runDispatcher(t, effects.Config{Pool: pool, Schema: schema, PollInterval: 20 * time.Millisecond, BatchSize: 7,
			Senders: map[string]effects.Sender{"mail": s.sender()}, Registerer: prometheus.NewRegistry()})
	}
	pgtest.WaitFor(t, 60*time.Second, "every effect done", func() bool {
		return pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE state = 'done'`) == len(want)
	})
	require.Equal(t, want, s.get(), "each effect sent once")
	require.Equal(t, len(want), pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE attempts = 1 AND fence = 1 AND recorded_fence = 1`))
}

// On Citus a Dispatcher without a Tenant takes over an effect whose lease ran
// out (its claimer died before recording): it sends it again as attempt 2 with
// the next fence, and records it done under that fence.
func TestCitusDispatcherTakesOverAStaleLease(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.CitusSetup(t, pgtest.Options{MaxConns: 6})
	_, w2 := pgtest.CitusTenants(t, pool, schema, "busy-", 1)
	enqueueFor(t, pool, schema, w2[0], "mail", 0, "stale")
	// A claim whose Dispatcher died: fenced, in flight, its lease ending soon.
	_, err := pool.Exec(context.Background(), `UPDATE effects SET fence = 1, attempts = 1, in_flight = true,
		next_attempt_at = now() + interval '1 second' WHERE tenant = $1`, w2[0])
	require.NoError(t, err)
	attempts := make(chan int, 4)
	runDispatcher(t, effects.Config{Pool: pool, Schema: schema, PollInterval: 50 * time.Millisecond,
		Senders: map[string]effects.Sender{"mail": effects.SenderFunc(func(_ context.Context, d effects.Delivery) error {
			attempts <- d.Attempt
			return nil
		})}, Registerer: prometheus.NewRegistry()})
	pgtest.WaitFor(t, 30*time.Second, "the stale effect done", func() bool {
		return pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE state = 'done' AND fence = 2 AND recorded_fence = 2 AND attempts = 2`) == 1
	})
	require.Equal(t, 2, <-attempts)
	require.Empty(t, attempts, "sent once")
}

// On Citus a Dispatcher without a Tenant goes on sending the tenants of the other
// worker while one is down (pg_ctl stop -m immediate), and resumes the crashed
// worker's once it is back: effects enqueued for both workers' tenants before,
// during and after the restart are all sent and recorded done. Only an effect of
// the crashed worker's tenant sent before the crash may be sent again: its
// outcome commits without waiting for its WAL flush, and a crash that loses it
// leaves the effect in flight, to be sent again after its lease (see
// writeOutcomes). The other worker's effects are each sent once.
func TestCitusDispatcherResumesAfterAWorkerRestart(t *testing.T) {
	ctx := context.Background()
	pool, schema, ctl := pgtest.CrashableCitus(t, pgtest.Options{MaxConns: 6})
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: schema, Citus: true})
	require.NoError(t, err)
	_, err = m.Up(ctx)
	require.NoError(t, err)
	w1, w2 := pgtest.CitusTenants(t, pool, schema, "busy-", 1)
	want := map[string]int{}
	enqueue := func(tenant, prefix string) {
		for i := range 10 {
			key := fmt.Sprint(prefix, i)
			enqueueFor(t, pool, schema, tenant, "mail", 0, key)
			want[tenant+"/mail/"+key] = 1
		}
	}
	done := func() bool {
		return pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE state = 'done'`) == len(want)
	}
	var s sends
	runDispatcher(t, effects.Config{Pool: pool, Schema: schema, PollInterval: 100 * time.Millisecond, Lease: 3 * time.Second,
		Senders: map[string]effects.Sender{"mail": s.sender()}, Registerer: prometheus.NewRegistry()})
	enqueue(w1[0], "before")
	enqueue(w2[0], "before")
	pgtest.WaitFor(t, 30*time.Second, "effects before the crash done", done)

	ctl.CrashWorker(1)
	enqueue(w2[0], "during")
	// While worker 1 is down, worker 2's tenant is still found and sent.
	pgtest.WaitFor(t, 30*time.Second, "worker 2's effects sent while worker 1 is down", func() bool {
		return pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE tenant = $1 AND key LIKE 'during%' AND state = 'done'`, w2[0]) == 10
	})
	ctl.StartWorker(1)
	enqueue(w1[0], "after")
	pgtest.WaitFor(t, 60*time.Second, "every effect done", done)
	got := s.get()
	for key := range want {
		n := got[key]
		if strings.HasPrefix(key, w1[0]+"/mail/before") {
			require.Contains(t, []int{1, 2}, n, "%s sent %d times", key, n)
			continue
		}
		require.Equal(t, 1, n, "%s sent %d times", key, n)
	}
	require.Len(t, got, len(want))
}
