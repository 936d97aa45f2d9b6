package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/shard"
)

// shardBiz creates the business table on every shard and answers where rows are.
type shardBiz struct {
	m *shard.Map
	// port of each shard's server, to tell from a transaction where it runs.
	ports map[int]string
}

func newShardBiz(t *testing.T, m *shard.Map) *shardBiz {
	t.Helper()
	sb := &shardBiz{m: m, ports: map[int]string{}}
	for _, s := range m.Shards {
		_, err := s.Pool.Exec(context.Background(), `CREATE TABLE biz (id bigserial PRIMARY KEY, tenant text NOT NULL, key text NOT NULL)`)
		require.NoError(t, err)
		sb.ports[int(s.Pool.Config().ConnConfig.Port)] = s.Name
	}
	return sb
}

// txShard is the name of the shard a transaction runs on.
func (sb *shardBiz) txShard(ctx context.Context, tx pgx.Tx) (string, error) {
	var port int
	if err := tx.QueryRow(ctx, `SELECT inet_server_port()`).Scan(&port); err != nil {
		return "", err
	}
	return sb.ports[port], nil
}

func (sb *shardBiz) want(t *testing.T, tenant string) string {
	t.Helper()
	s, err := sb.m.Pick(tenant)
	require.NoError(t, err)
	return s.Name
}

// rows counts, per shard, the rows of table with key.
func (sb *shardBiz) rows(t *testing.T, table, key string) map[string]int {
	t.Helper()
	out := map[string]int{}
	for _, s := range sb.m.Shards {
		if n := pgtest.ShardCount(t, s, `SELECT count(*) FROM `+table+` WHERE key = $1`, key); n > 0 {
			out[s.Name] = n
		}
	}
	return out
}

func tenantMsg(tenant, key string) *message.Message {
	msg := message.NewMessage(key, []byte(`{"k":"`+key+`"}`))
	msg.Metadata.Set("tenant", tenant)
	return msg
}

func shardedConsumer(t *testing.T, m *shard.Map, mode consumer.Mode, mutate ...func(*consumer.Config)) *consumer.Consumer {
	t.Helper()
	cfg := consumer.Config{Name: "orders", Shards: m, Tenant: consumer.MetadataKey("tenant"), Mode: mode,
		LockTimeout: 2 * time.Second, BusyDelay: time.Millisecond, Registerer: prometheus.NewRegistry()}
	for _, f := range mutate {
		f(&cfg)
	}
	c, err := consumer.New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// Each message is claimed, handled and committed on its tenant's shard, in every
// mode; redeliveries are duplicates there.
func TestShardsRouteEachTenantToItsShard(t *testing.T) {
	t.Parallel()
	forAllModes(t, func(t *testing.T, mode consumer.Mode) {
		m := pgtest.Shards(t)
		sb := newShardBiz(t, m)
		c := shardedConsumer(t, m, mode)
		var wrong atomic.Int64
		h := c.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			tx := consumer.Tx(ctx)
			if mode == consumer.Lease {
				return nil, nil // no transaction of idem's in Lease mode
			}
			got, err := sb.txShard(ctx, tx)
			if err != nil {
				return nil, err
			}
			if got != sb.want(t, msg.Metadata.Get("tenant")) {
				wrong.Add(1)
			}
			_, err = tx.Exec(ctx, `INSERT INTO biz (tenant, key) VALUES ($1, $2)`, msg.Metadata.Get("tenant"), msg.UUID)
			return nil, err
		})
		const tenants = 24
		var keys []string
		for round := range 2 {
			for i := range tenants {
				key := fmt.Sprintf("k-%d", i)
				if round == 0 {
					keys = append(keys, key)
				}
				_, err := h(tenantMsg(fmt.Sprintf("tenant-%d", i), key))
				require.NoError(t, err)
			}
		}
		require.Zero(t, wrong.Load(), "every handler ran in its tenant's shard's transaction")
		used := map[string]bool{}
		for i, key := range keys {
			want := sb.want(t, fmt.Sprintf("tenant-%d", i))
			used[want] = true
			require.Equal(t, map[string]int{want: 1}, sb.rows(t, "inbox", key), "inbox row of %s only on its shard", key)
			if mode != consumer.Lease {
				require.Equal(t, map[string]int{want: 1}, sb.rows(t, "biz", key), "business row of %s committed once, on its shard", key)
			}
		}
		require.Len(t, used, len(m.Shards), "the tenants spread over every shard")
	})
}

// A group-commit or batch-handler batch holds one shard's messages, in one
// transaction on that shard.
func TestShardedBatchIsSplitPerShard(t *testing.T) {
	t.Parallel()
	for _, batch := range []bool{false, true} {
		t.Run(map[bool]string{false: "group-commit", true: "batch-handler"}[batch], func(t *testing.T) {
			t.Parallel()
			m := pgtest.Shards(t)
			sb := newShardBiz(t, m)
			var mu sync.Mutex
			type seen struct{ tx, want string }
			var ran []seen // per message: its transaction (shard and txid), its tenant's shard
			note := func(ctx context.Context, tx pgx.Tx, msgs []*message.Message) error {
				got, err := sb.txShard(ctx, tx)
				if err != nil {
					return err
				}
				var txid int64
				if err := tx.QueryRow(ctx, `SELECT txid_current()`).Scan(&txid); err != nil {
					return err
				}
				for _, msg := range msgs {
					mu.Lock()
					ran = append(ran, seen{fmt.Sprintf("%s/%d", got, txid), sb.want(t, msg.Metadata.Get("tenant"))})
					mu.Unlock()
					if _, err := tx.Exec(ctx, `INSERT INTO biz (tenant, key) VALUES ($1, $2)`, msg.Metadata.Get("tenant"), msg.UUID); err != nil {
						return err
					}
				}
				return nil
			}
			var h func(*message.Message) error
			if batch {
				c := shardedConsumer(t, m, consumer.Transactional, batched)
				h = c.HandleBatch(note)
			} else {
				c := shardedConsumer(t, m, consumer.GroupCommit, batched)
				mw := c.Middleware(func(msg *message.Message) ([]*message.Message, error) {
					return nil, note(msg.Context(), consumer.Tx(msg.Context()), []*message.Message{msg})
				})
				h = func(msg *message.Message) error { _, err := mw(msg); return err }
			}
			const n = 60
			var wg sync.WaitGroup
			errs := make(chan error, n)
			for i := range n {
				wg.Add(1)
				go func() {
					defer wg.Done()
					errs <- h(tenantMsg(fmt.Sprintf("tenant-%d", i%12), fmt.Sprintf("k-%d", i)))
				}()
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				require.NoError(t, err)
			}
			mu.Lock()
			defer mu.Unlock()
			perTx := map[string]int{}
			for _, r := range ran {
				require.Equal(t, r.want, r.tx[:len(r.want)], "a message ran in a transaction on its own shard: %v", r)
				perTx[r.tx]++
			}
			require.GreaterOrEqual(t, len(ran), n, "every message ran (a round may run again)")
			require.Less(t, len(perTx), n, "some transactions batched several messages")
			for i := range n {
				want := sb.want(t, fmt.Sprintf("tenant-%d", i%12))
				require.Equal(t, map[string]int{want: 1}, sb.rows(t, "inbox", fmt.Sprintf("k-%d", i)))
			}
		})
	}
}

// A route that fails is a coded, permanent error, and nothing is claimed.
func TestShardRouteErrorIsReturned(t *testing.T) {
	t.Parallel()
	m := pgtest.Shards(t)
	m.Route = func(tenant string) (string, error) {
		if tenant == "lost" {
			return "", errors.New("directory down")
		}
		return "s1", nil
	}
	c := shardedConsumer(t, m, consumer.Transactional)
	h := c.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	_, err := h(tenantMsg("lost", "k1"))
	require.ErrorIs(t, err, shard.ErrRoute)
	require.Equal(t, "shard_route", inbox.Code(err))
	require.True(t, consumer.IsPermanent(err))
	_, err = h(tenantMsg("found", "k2"))
	require.NoError(t, err)
	sb := &shardBiz{m: m}
	require.Equal(t, map[string]int{"s1": 1}, sb.rows(t, "inbox", "k2"))
	require.Empty(t, sb.rows(t, "inbox", "k1"))
}

// One shard crashes (pg_ctl stop -m immediate) in the middle of a stream: its
// messages are nacked with database_unavailable (or commit_unknown for a COMMIT in
// flight), the other shards' messages keep committing meanwhile, and after the
// restart and the redeliveries every key has committed exactly once, on its own
// shard, with its one effect.
func TestShardCrashMidStream(t *testing.T) {
	m, ctl := pgtest.CrashableShards(t)
	sb := newShardBiz(t, m)
	for _, mode := range []consumer.Mode{consumer.Transactional, consumer.GroupCommit} {
		t.Run(mode.String(), func(t *testing.T) {
			crashMidStream(t, m, ctl, sb, mode)
		})
	}
}

func crashMidStream(t *testing.T, m *shard.Map, ctl *pgtest.ShardCtl, sb *shardBiz, mode consumer.Mode) {
	const down = 1 // s2
	c := shardedConsumer(t, m, mode, func(cfg *consumer.Config) { cfg.Name = "stream-" + mode.String() })
	h := c.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx := consumer.Tx(ctx)
		if _, err := tx.Exec(ctx, `INSERT INTO biz (tenant, key) VALUES ($1, $2)`, msg.Metadata.Get("tenant"), msg.UUID); err != nil {
			return nil, err
		}
		_, err := effects.Enqueue(ctx, tx, effects.Effect{Kind: "email", Key: "mail:" + msg.UUID, Payload: msg.Payload})
		return nil, err
	})
	type item struct{ tenant, key string }
	var all []item
	for i := range 400 {
		all = append(all, item{fmt.Sprintf("tenant-%d", i%40), fmt.Sprintf("%s-%d", mode, i)})
	}
	downName := m.Shards[down].Name

	var mu sync.Mutex
	var nacked []item
	var otherFailures []error
	committedWhileDown := map[string]int{}
	var isDown atomic.Bool
	deliver := func(it item) {
		_, err := h(tenantMsg(it.tenant, it.key))
		mu.Lock()
		defer mu.Unlock()
		if err == nil {
			if isDown.Load() && sb.want(t, it.tenant) != downName {
				committedWhileDown[sb.want(t, it.tenant)]++
			}
			return
		}
		nacked = append(nacked, it)
		if sb.want(t, it.tenant) != downName {
			otherFailures = append(otherFailures, fmt.Errorf("%s on %s: %w", it.key, sb.want(t, it.tenant), err))
			return
		}
		if code := inbox.Code(err); code != "database_unavailable" && code != "commit_unknown" && code != "batch_aborted" {
			otherFailures = append(otherFailures, fmt.Errorf("%s on the crashed shard nacked with code %q: %w", it.key, code, err))
		}
	}
	// stream delivers items on 6 workers; at item crashAt, if set, the shard is
	// crashed while the stream goes on, and from item crashAt+150 on the stream
	// waits until the crash is done, so the rest runs with the shard down.
	stream := func(items []item, crashAt int) {
		ch := make(chan item)
		var wg sync.WaitGroup
		for range 6 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for it := range ch {
					deliver(it)
				}
			}()
		}
		var crashed sync.WaitGroup
		for i, it := range items {
			if crashAt > 0 && i == crashAt {
				crashed.Add(1)
				go func() {
					defer crashed.Done()
					ctl.Crash(down)
					isDown.Store(true)
				}()
			}
			if crashAt > 0 && i == crashAt+150 {
				crashed.Wait()
			}
			ch <- it
		}
		close(ch)
		wg.Wait()
		crashed.Wait()
	}
	stream(all, 100)
	mu.Lock()
	require.Empty(t, otherFailures, "only the crashed shard's messages are nacked, with its own codes")
	require.NotEmpty(t, nacked, "the crashed shard's messages were nacked")
	for i, s := range m.Shards {
		if i != down {
			require.Positive(t, committedWhileDown[s.Name], "shard %s kept committing while %s was down", s.Name, downName)
		}
	}
	retry := slices.Clone(nacked)
	nacked = nil
	mu.Unlock()

	ctl.Start(down)
	// Redeliver what was nacked until it all commits, then everything once more.
	deadline := time.Now().Add(60 * time.Second)
	for len(retry) > 0 {
		require.True(t, time.Now().Before(deadline), "redeliveries still nacked: %d", len(retry))
		stream(retry, 0)
		mu.Lock()
		retry, nacked = nacked, nil
		otherFailures = nil
		mu.Unlock()
	}
	stream(all, 0)
	mu.Lock()
	require.Empty(t, nacked)
	mu.Unlock()

	for _, it := range all {
		want := sb.want(t, it.tenant)
		require.Equal(t, map[string]int{want: 1}, sb.rows(t, "biz", it.key), "%s committed once, on %s", it.key, want)
		require.Equal(t, map[string]int{want: 1}, sb.rows(t, "inbox", it.key))
		require.Equal(t, map[string]int{want: 1}, effectRows(t, sb, "mail:"+it.key))
	}

	// One Dispatcher over the shards sends every effect once.
	var sentMu sync.Mutex
	sent := map[string]int{}
	d, err := effects.NewDispatcher(effects.Config{Shards: m, PollInterval: 50 * time.Millisecond,
		Senders: map[string]effects.Sender{"email": effects.SenderFunc(func(_ context.Context, d effects.Delivery) error {
			sentMu.Lock()
			sent[d.Key]++
			sentMu.Unlock()
			return nil
		})}})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { _ = d.Run(ctx) })
	require.Eventually(t, func() bool {
		sentMu.Lock()
		defer sentMu.Unlock()
		return len(sent) >= len(all)
	}, 30*time.Second, 10*time.Millisecond)
	cancel()
	wg.Wait()
	for _, it := range all {
		require.Equal(t, 1, sent["mail:"+it.key], "effect of %s sent once", it.key)
	}
	for _, s := range m.Shards {
		require.Zero(t, pgtest.ShardCount(t, s, `SELECT count(*) FROM effects WHERE state <> 'done' AND key LIKE $1`, "mail:"+mode.String()+"-%"))
	}
}

func effectRows(t *testing.T, sb *shardBiz, key string) map[string]int {
	t.Helper()
	out := map[string]int{}
	for _, s := range sb.m.Shards {
		if n := pgtest.ShardCount(t, s, `SELECT count(*) FROM effects WHERE key = $1`, key); n > 0 {
			out[s.Name] = n
		}
	}
	return out
}

// Over a shard map every series carries its shard's name, so the shards (which
// share a schema name here) never add up: each shard's processed, duplicates and
// permanent-failure counts are its own inbox rows. Two consumers of one map on one
// registry share the series.
func TestShardedMetricsCarryTheShard(t *testing.T) {
	t.Parallel()
	for _, mode := range []consumer.Mode{consumer.Transactional, consumer.GroupCommit} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			m := pgtest.Shards(t)
			reg := prometheus.NewRegistry()
			useReg := func(cfg *consumer.Config) { cfg.Registerer = reg }
			c := shardedConsumer(t, m, mode, useReg)
			shardedConsumer(t, m, mode, useReg) // a second one shares the collectors
			h := c.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				if msg.Metadata.Get("fail") != "" {
					return nil, consumer.Permanent(errors.New("refused"))
				}
				return nil, nil
			})
			for round := range 2 {
				for i := range 18 {
					msg := tenantMsg(fmt.Sprintf("tenant-%d", i), fmt.Sprintf("k-%d", i))
					if i%5 == 0 {
						msg.Metadata.Set("fail", "yes")
					}
					_, err := h(msg) // a permanent failure is recorded and acked
					require.NoError(t, err, "round %d", round)
				}
			}
			mfs, err := reg.Gather()
			require.NoError(t, err)
			for _, mf := range mfs {
				for _, s := range mf.GetMetric() {
					require.True(t, slices.ContainsFunc(s.GetLabel(), func(l *dto.LabelPair) bool { return l.GetName() == "shard" }),
						"%s%v has no shard label", mf.GetName(), s.GetLabel())
				}
			}
			for _, s := range m.Shards {
				on := map[string]string{"consumer": "orders", "shard": s.Name}
				done := pgtest.ShardCount(t, s, `SELECT count(*) FROM inbox WHERE consumer = 'orders' AND state = 'completed'`)
				failed := pgtest.ShardCount(t, s, `SELECT count(*) FROM inbox WHERE consumer = 'orders' AND state = 'failed'`)
				require.Positive(t, done, "tenants on %s", s.Name)
				require.EqualValues(t, done, series(t, reg, "idem_inbox_processed_total", on), "processed on %s", s.Name)
				require.EqualValues(t, done, series(t, reg, "idem_inbox_duplicates_total", on), "duplicates on %s", s.Name)
				require.EqualValues(t, failed, series(t, reg, "idem_inbox_failed_total",
					map[string]string{"consumer": "orders", "shard": s.Name, "code": "permanent", "replayed": "false"}), "failed on %s", s.Name)
				require.EqualValues(t, failed, series(t, reg, "idem_inbox_failed_total",
					map[string]string{"consumer": "orders", "shard": s.Name, "code": "permanent", "replayed": "true"}), "replayed failures on %s", s.Name)
			}
		})
	}
}
