package effects_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/shard"
)

// enqueueOn commits one effect for tenant on shard s.
func enqueueOn(t *testing.T, s shard.Shard, tenant, key string) {
	t.Helper()
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		_, err := effects.Enqueue(effects.WithScope(ctx, effects.Scope{Schema: s.SchemaName(), Tenant: tenant}), tx,
			effects.Effect{Kind: "email", Key: key, Payload: []byte(`{}`)})
		return err
	})
	require.NoError(t, err)
}

// listening waits until every shard has a backend of the test LISTENing.
func listening(t *testing.T, m *shard.Map, which ...int) {
	t.Helper()
	if which == nil {
		for i := range m.Shards {
			which = append(which, i)
		}
	}
	for _, i := range which {
		s := m.Shards[i]
		require.Eventually(t, func() bool {
			var n int
			err := s.Pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
				WHERE application_name = $1 AND query = 'LISTEN idem_effects'`, "idem-test:"+s.Schema).Scan(&n)
			return err == nil && n >= 1
		}, 20*time.Second, 20*time.Millisecond, "the Dispatcher LISTENs on %s", s.Name)
	}
}

// runSharded runs a Dispatcher of "email" over m until the test ends, and returns
// its registry.
func runSharded(t *testing.T, m *shard.Map, rec *recorder, poll time.Duration) *prometheus.Registry {
	t.Helper()
	reg := prometheus.NewRegistry()
	d, err := effects.NewDispatcher(effects.Config{Shards: m, Senders: map[string]effects.Sender{"email": rec},
		PollInterval: poll, Registerer: reg, PendingRefresh: 50 * time.Millisecond})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { require.NoError(t, d.Run(ctx)) })
	t.Cleanup(func() { cancel(); wg.Wait() })
	return reg
}

// One Dispatcher serves every shard, and LISTEN wakes it on each: with an hour's
// poll, every effect is sent at once.
func TestDispatcherServesEveryShardByListen(t *testing.T) {
	t.Parallel()
	m := pgtest.Shards(t)
	rec := newRecorder(nil)
	runSharded(t, m, rec, time.Hour)
	listening(t, m)
	for _, s := range m.Shards {
		enqueueOn(t, s, "tenant", "mail-"+s.Name)
	}
	for _, s := range m.Shards {
		require.Eventually(t, func() bool { return rec.count("mail-"+s.Name) == 1 }, 10*time.Second, 10*time.Millisecond,
			"the effect on %s was sent", s.Name)
	}
}

// A shard that restarts is served again without restarting the Dispatcher: while
// it is down the other shards' effects go out, and once it is back its LISTEN
// connection reconnects and wakes the claim loop (the poll is an hour here, so
// nothing else could).
func TestDispatcherPicksUpARestartedShard(t *testing.T) {
	m, ctl := pgtest.CrashableShards(t)
	rec := newRecorder(nil)
	runSharded(t, m, rec, time.Hour)
	listening(t, m)

	ctl.Crash(1)
	enqueueOn(t, m.Shards[0], "t", "while-down-s1")
	enqueueOn(t, m.Shards[2], "t", "while-down-s3")
	for _, key := range []string{"while-down-s1", "while-down-s3"} {
		require.Eventually(t, func() bool { return rec.count(key) == 1 }, 10*time.Second, 10*time.Millisecond, key)
	}

	ctl.Start(1)
	// The pool's connections to the old server are gone; a fresh one commits.
	require.Eventually(t, func() bool {
		err := pgx.BeginFunc(context.Background(), m.Shards[1].Pool, func(tx pgx.Tx) error {
			_, err := effects.Enqueue(effects.WithScope(context.Background(), effects.Scope{Schema: m.Shards[1].SchemaName()}), tx,
				effects.Effect{Kind: "email", Key: "after-restart", Payload: []byte(`{}`)})
			return err
		})
		return err == nil
	}, 20*time.Second, 50*time.Millisecond)
	require.Eventually(t, func() bool { return rec.count("after-restart") == 1 }, 20*time.Second, 10*time.Millisecond,
		"the restarted shard's effect was sent")
	listening(t, m, 1)
	enqueueOn(t, m.Shards[1], "t", "listen-again")
	require.Eventually(t, func() bool { return rec.count("listen-again") == 1 }, 10*time.Second, 10*time.Millisecond)
	require.Equal(t, 1, rec.count("while-down-s1"))
	require.Equal(t, 1, rec.count("after-restart"))
}

// Over a shard map every series carries its shard's name, so the shards (which
// share a schema name here) never add up: each shard's pending gauge counts its
// own pending effects, even of a kind this Dispatcher does not send, and its done
// attempts are its own done rows.
func TestShardedDispatcherMetricsCarryTheShard(t *testing.T) {
	t.Parallel()
	m := pgtest.Shards(t)
	reg := runSharded(t, m, newRecorder(nil), 20*time.Millisecond)
	ctx := context.Background()
	for i, s := range m.Shards {
		err := pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
			var batch []effects.Effect
			for j := range i + 1 {
				batch = append(batch, effects.Effect{Kind: "email", Key: fmt.Sprintf("mail-%s-%d", s.Name, j), Payload: []byte(`{}`)})
			}
			for j := range len(m.Shards) - i {
				batch = append(batch, effects.Effect{Kind: "sms", Key: fmt.Sprintf("sms-%s-%d", s.Name, j), Payload: []byte(`{}`)})
			}
			for _, e := range batch {
				if _, err := effects.Enqueue(effects.WithScope(ctx, effects.Scope{Schema: s.SchemaName(), Tenant: "t"}), tx, e); err != nil {
					return err
				}
			}
			return nil
		})
		require.NoError(t, err)
	}
	for i, s := range m.Shards {
		pgtest.WaitFor(t, 20*time.Second, "the emails on "+s.Name+" are done", func() bool {
			return pgtest.ShardCount(t, s, `SELECT count(*) FROM effects WHERE kind = 'email' AND state = 'done'`) == i+1
		})
		pgtest.WaitFor(t, 20*time.Second, "the metrics of "+s.Name, func() bool {
			return metricValue(t, reg, "idem_effects_attempts_total", "email", "done", s.Name) == float64(i+1) &&
				metricValue(t, reg, "idem_effects_pending", "sms", s.Name) == float64(len(m.Shards)-i) &&
				metricValue(t, reg, "idem_effects_pending", "email", s.Name) == 0
		})
		require.EqualValues(t, len(m.Shards)-i, pgtest.ShardCount(t, s, `SELECT count(*) FROM effects WHERE kind = 'sms' AND state = 'pending'`))
	}
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		for _, one := range mf.GetMetric() {
			require.True(t, slices.ContainsFunc(one.GetLabel(), func(l *dto.LabelPair) bool { return l.GetName() == "shard" }),
				"%s%v has no shard label", mf.GetName(), one.GetLabel())
		}
	}
}

// A Dispatcher over a shard map with Config.Tenant serves that tenant's effects
// on every shard, and no other tenant's.
func TestDispatcherTenantOverShards(t *testing.T) {
	t.Parallel()
	m := pgtest.Shards(t)
	for _, s := range m.Shards {
		enqueueOn(t, s, "a", "a-"+s.Name)
		enqueueOn(t, s, "b", "b-"+s.Name)
	}
	rec := newRecorder(nil)
	d, err := effects.NewDispatcher(effects.Config{Shards: m, Tenant: "a", Senders: map[string]effects.Sender{"email": rec},
		PollInterval: 20 * time.Millisecond})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	for _, s := range m.Shards {
		require.Eventually(t, func() bool {
			return pgtest.ShardCount(t, s, `SELECT count(*) FROM effects WHERE tenant = 'a' AND state = 'done'`) == 1
		}, 20*time.Second, 10*time.Millisecond, "a's effect on %s sent", s.Name)
	}
	cancel()
	require.NoError(t, <-done)
	for _, s := range m.Shards {
		require.Equal(t, 1, pgtest.ShardCount(t, s, `SELECT count(*) FROM effects
			WHERE tenant = 'b' AND state = 'pending' AND attempts = 0 AND fence = 0`), "b's effect on %s untouched", s.Name)
		require.Equal(t, 1, rec.count("a-"+s.Name))
		require.Zero(t, rec.count("b-"+s.Name))
	}
}
