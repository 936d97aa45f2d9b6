package admin_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/shard"
)

// seedShard writes inbox keys and effects of the tenant on its shard: n completed
// keys of consumer c, n pending effects of kind k, and, when failed > 0, that many
// failed keys of consumer "fail-"+c with one error text (one failure group) and as
// many dead effects of kind "dead-"+k.
func seedShard(t *testing.T, m *shard.Map, tenant, c, k string, n, failed int) {
	t.Helper()
	s, err := m.Pick(tenant)
	require.NoError(t, err)
	ctx := context.Background()
	_, err = s.Pool.Exec(ctx, `INSERT INTO inbox (consumer, tenant, key, fingerprint, state, expires_at, completed_at)
		SELECT $1, $2, 'k' || lpad(g::text, 4, '0'), '\x00', 'completed', now() + interval '1 day', now()
		FROM generate_series(1, $3) g`, c, tenant, n)
	require.NoError(t, err)
	_, err = s.Pool.Exec(ctx, `INSERT INTO effects (tenant, kind, key, fingerprint)
		SELECT $1, $2, 'e' || lpad(g::text, 4, '0'), '\x00' FROM generate_series(1, $3) g`, tenant, k, n)
	require.NoError(t, err)
	if failed > 0 {
		_, err = s.Pool.Exec(ctx, `INSERT INTO inbox (consumer, tenant, key, fingerprint, state, expires_at, completed_at, error_code, error)
			SELECT 'fail-' || $1, $2, 'f' || g, '\x00', 'failed', now() + interval '1 day', now(), 'handler', 'order ' || g || ' refused'
			FROM generate_series(1, $3) g`, c, tenant, failed)
		require.NoError(t, err)
		_, err = s.Pool.Exec(ctx, `INSERT INTO effects (tenant, kind, key, fingerprint, state, attempts, last_error, dead_at)
			SELECT $1, 'dead-' || $2, 'd' || g, '\x00', 'dead', 3, 'provider said ' || g, now()
			FROM generate_series(1, $3) g`, tenant, k, failed)
		require.NoError(t, err)
	}
}

// pageAll pages a merged list with a small limit and returns the rows' identities
// in page order, failing on a duplicate.
func pageAll(t *testing.T, limit int, page func(after string) ([]string, string, error)) []string {
	t.Helper()
	var out []string
	seen := map[string]bool{}
	after := ""
	for i := 0; ; i++ {
		require.Less(t, i, 10000, "paging does not end")
		ids, next, err := page(after)
		require.NoError(t, err)
		require.LessOrEqual(t, len(ids), limit)
		for _, id := range ids {
			require.False(t, seen[id], "row %s appears twice", id)
			seen[id] = true
		}
		out = append(out, ids...)
		if next == "" {
			return out
		}
		after = next
	}
}

// TestShardsMergedPagesNoGapNoDuplicate: over 3 real shard clusters, every list
// (inbox keys, effects, failure groups, repair actions) paged 7 at a time while
// other goroutines insert rows on every shard returns each row that was there
// before once, never one twice, in the list's order, each naming its shard.
func TestShardsMergedPagesNoGapNoDuplicate(t *testing.T) {
	t.Parallel()
	m := pgtest.Shards(t)
	a, err := admin.New(admin.Config{Shards: m})
	require.NoError(t, err)
	ctx := context.Background()

	// Tenants spread over every shard, each with rows and one failure group of
	// each source of a size of its own (so that the count order is total).
	var tenants []string
	perShard := map[string]int{}
	for i := 0; len(tenants) < 12; i++ {
		tenant := fmt.Sprintf("t%02d", i)
		s, _ := m.Pick(tenant)
		if perShard[s.Name] >= 4 {
			continue
		}
		perShard[s.Name]++
		tenants = append(tenants, tenant)
		seedShard(t, m, tenant, "orders", "mail", 5+len(tenants), len(tenants))
	}
	require.Len(t, perShard, 3)

	// Repair actions on some groups of every shard: the audit list.
	groups, err := a.ListGroups(ctx, admin.GroupFilter{Source: admin.SourceEffects}, admin.Page{Limit: 100})
	require.NoError(t, err)
	require.Len(t, groups.Rows, 12)
	for _, g := range groups.Rows[:9] {
		_, err := a.DiscardGroup(ctx, admin.GroupAction{ID: g.ID, Through: g.LastSeen, Note: admin.Audit{Who: "test", Why: "paging"}})
		require.NoError(t, err)
	}

	// What was there before the inserts, read shard by shard.
	want := func(sql string) []string {
		var out []string
		for _, s := range m.Shards {
			rows, err := s.Pool.Query(ctx, sql)
			require.NoError(t, err)
			for rows.Next() {
				var id string
				require.NoError(t, rows.Scan(&id))
				out = append(out, s.Name+"|"+id)
			}
			require.NoError(t, rows.Err())
		}
		return out
	}
	wantInbox := want(`SELECT consumer || '/' || tenant || '/' || key FROM inbox`)
	wantEffects := want(`SELECT tenant || '/' || kind || '/' || key FROM effects`)
	wantActions := want(`SELECT id::text FROM failure_actions`)
	require.Len(t, wantActions, 9)
	var wantGroups []string
	inboxGroups, err := a.ListGroups(ctx, admin.GroupFilter{}, admin.Page{Limit: 1000})
	require.NoError(t, err)
	for _, g := range inboxGroups.Rows {
		wantGroups = append(wantGroups, g.Shard+"|"+g.ID)
	}
	require.Len(t, wantGroups, 12+3, "12 inbox groups and the 3 effects groups not discarded")

	// Concurrent inserts on every shard, before and after every cursor.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var once sync.Once
	halt := func() { once.Do(func() { close(stop) }); wg.Wait() }
	defer halt()
	var inserted atomic.Int64
	for w := range 3 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				tenant := tenants[rand.IntN(len(tenants))]
				s, _ := m.Pick(tenant)
				_, err := s.Pool.Exec(ctx, `INSERT INTO inbox (consumer, tenant, key, fingerprint, state, expires_at) VALUES
					($1, $2, $3, '\x00', 'completed', now() + interval '1 day')`,
					[]string{"a-new", "orders", "zz-new"}[i%3], tenant, fmt.Sprintf("n%d-%d", w, i))
				if err == nil {
					_, err = s.Pool.Exec(ctx, `INSERT INTO effects (tenant, kind, key, fingerprint) VALUES ($1, $2, $3, '\x00')`,
						tenant, []string{"a-new", "mail", "zz-new"}[i%3], fmt.Sprintf("n%d-%d", w, i))
				}
				if err != nil {
					t.Error(err)
					return
				}
				inserted.Add(1)
			}
		})
	}

	const limit = 7
	lastInbox := map[string]admin.InboxKey{}
	gotInbox := pageAll(t, limit, func(after string) ([]string, string, error) {
		p, err := a.ListInbox(ctx, admin.InboxFilter{}, admin.Page{Limit: limit, After: after})
		if err != nil {
			return nil, "", err
		}
		var ids []string
		for _, k := range p.Rows {
			require.NotEmpty(t, k.Shard)
			require.True(t, orderedInbox(lastInbox[k.Shard], k), "inbox out of its shard's order: %+v after %+v", k, lastInbox[k.Shard])
			lastInbox[k.Shard] = k
			ids = append(ids, k.Shard+"|"+k.Consumer+"/"+k.Tenant+"/"+k.Key)
		}
		return ids, p.Next, nil
	})
	lastEffect := map[string]admin.Effect{}
	gotEffects := pageAll(t, limit, func(after string) ([]string, string, error) {
		p, err := a.ListEffects(ctx, admin.EffectFilter{}, admin.Page{Limit: limit, After: after})
		if err != nil {
			return nil, "", err
		}
		var ids []string
		for _, e := range p.Rows {
			require.True(t, orderedEffect(lastEffect[e.Shard], e), "effects out of their shard's order: %+v after %+v", e, lastEffect[e.Shard])
			lastEffect[e.Shard] = e
			ids = append(ids, e.Shard+"|"+e.Tenant+"/"+e.Kind+"/"+e.Key)
		}
		return ids, p.Next, nil
	})
	for _, order := range []string{admin.ByCount, admin.ByRecent} {
		got := pageAll(t, 2, func(after string) ([]string, string, error) {
			p, err := a.ListGroups(ctx, admin.GroupFilter{Order: order}, admin.Page{Limit: 2, After: after})
			if err != nil {
				return nil, "", err
			}
			var ids []string
			for _, g := range p.Rows {
				ids = append(ids, g.Shard+"|"+g.ID)
			}
			return ids, p.Next, nil
		})
		require.ElementsMatch(t, wantGroups, got, order)
	}
	gotActions := pageAll(t, 2, func(after string) ([]string, string, error) {
		p, err := a.ListActions(ctx, admin.ActionFilter{}, admin.Page{Limit: 2, After: after})
		if err != nil {
			return nil, "", err
		}
		var ids []string
		for i, x := range p.Rows {
			if i > 0 {
				require.False(t, x.At.After(p.Rows[i-1].At), "actions newest first")
			}
			ids = append(ids, x.Shard+"|"+x.ID)
		}
		return ids, p.Next, nil
	})
	halt()
	require.Positive(t, inserted.Load())

	require.Subset(t, gotInbox, wantInbox, "a key that was there before paging is missing")
	require.Subset(t, gotEffects, wantEffects, "an effect that was there before paging is missing")
	// The rows that were there before paging come in key order across the shards.
	inOrder(t, gotInbox, wantInbox)
	inOrder(t, gotEffects, wantEffects)
	require.ElementsMatch(t, wantActions, gotActions)
	t.Logf("%d inbox keys and %d effects paged while %d pairs were inserted", len(gotInbox), len(gotEffects), inserted.Load())
}

// inOrder checks that the rows of got that are in want come in key order (the
// part after "shard|"), ties by shard.
func inOrder(t *testing.T, got, want []string) {
	t.Helper()
	before := map[string]bool{}
	for _, w := range want {
		before[w] = true
	}
	last := ""
	for _, g := range got {
		if !before[g] {
			continue
		}
		shardName, key, _ := strings.Cut(g, "|")
		k := strings.ReplaceAll(key, "/", "\x00") + "\x00" + shardName
		require.Less(t, last, k, "rows out of key order across the shards")
		last = k
	}
}

func orderedInbox(prev, k admin.InboxKey) bool {
	if prev.Consumer != k.Consumer {
		return prev.Consumer < k.Consumer
	}
	if prev.Tenant != k.Tenant {
		return prev.Tenant < k.Tenant
	}
	if prev.Key != k.Key {
		return prev.Key < k.Key
	}
	return prev.Shard < k.Shard
}

func orderedEffect(prev, e admin.Effect) bool {
	if prev.Tenant != e.Tenant {
		return prev.Tenant < e.Tenant
	}
	if prev.Kind != e.Kind {
		return prev.Kind < e.Kind
	}
	if prev.Key != e.Key {
		return prev.Key < e.Key
	}
	return prev.Shard < e.Shard
}

// TestShardsStatsInspectAndGroups: Stats sums the shards and lists each; one key
// is found on its shard; a failure group's actions act on its shard's rows, and
// the failure metrics count each shard's rows under its name; a cursor of another
// list or of a single database is refused.
func TestShardsStatsInspectAndGroups(t *testing.T) {
	t.Parallel()
	m := pgtest.Shards(t)
	reg := prometheus.NewRegistry()
	a, err := admin.New(admin.Config{Shards: m, Registerer: reg, MetricsInterval: time.Nanosecond})
	require.NoError(t, err)
	// metric is the value of name{label=value, shard=s}.
	metric := func(name, label, value, s string) float64 {
		mfs, err := reg.Gather()
		require.NoError(t, err)
		for _, mf := range mfs {
			for _, one := range mf.GetMetric() {
				l := map[string]string{}
				for _, p := range one.GetLabel() {
					l[p.GetName()] = p.GetValue()
				}
				if mf.GetName() == name && l[label] == value && l["shard"] == s {
					return one.GetGauge().GetValue() + one.GetCounter().GetValue()
				}
			}
		}
		return -1
	}
	ctx := context.Background()
	var tenants []string
	seen := map[string]bool{}
	for i := 0; len(tenants) < 3; i++ {
		tenant := fmt.Sprintf("u%d", i)
		if s, _ := m.Pick(tenant); !seen[s.Name] {
			seen[s.Name] = true
			tenants = append(tenants, tenant)
			seedShard(t, m, tenant, "orders", "mail", 4, 2)
		}
	}
	st, err := a.Stats(ctx)
	require.NoError(t, err)
	require.Len(t, st.Shards, 3)
	for _, s := range st.Shards {
		require.True(t, s.Up())
		require.Len(t, s.Consumers, 2)
	}
	require.Equal(t, []admin.ConsumerStats{
		{Consumer: "fail-orders", Rows: 6, Failed: 6},
		{Consumer: "orders", Rows: 12, Completed: 12},
	}, clearTimes(st.Consumers))
	require.Equal(t, "dead-mail", st.Effects[0].Kind)
	require.Equal(t, int64(6), st.Effects[0].Dead)
	for _, s := range m.Shards {
		require.Equal(t, 2.0, metric("idem_inbox_failed_keys", "consumer", "fail-orders", s.Name), "failed keys on %s", s.Name)
		require.Equal(t, 2.0, metric("idem_effects_dead_rows", "kind", "dead-mail", s.Name), "dead effects on %s", s.Name)
	}
	require.Equal(t, int64(12), st.Effects[1].Pending)
	act, err := a.Activity(ctx, time.Hour)
	require.NoError(t, err)
	require.Len(t, act.Minutes, 60)
	var completed, failed, pending int64
	for _, m := range act.Minutes {
		completed, failed = completed+m.Completed, failed+m.Failed
	}
	pending = act.Minutes[len(act.Minutes)-1].Pending
	require.Equal(t, []int64{12, 6, 12}, []int64{completed, failed, pending}, "the activity of every shard")

	want, _ := m.Pick(tenants[1])
	k, err := a.InspectInbox(ctx, inbox.ID{Consumer: "orders", Tenant: tenants[1], Key: "k0002"}, admin.InspectOptions{})
	require.NoError(t, err)
	require.Equal(t, want.Name, k.Shard)
	_, err = a.InspectInbox(ctx, inbox.ID{Consumer: "orders", Tenant: tenants[1], Key: "nope"}, admin.InspectOptions{})
	require.ErrorIs(t, err, admin.ErrNotFound)
	e, err := a.InspectEffect(ctx, admin.EffectID{Tenant: tenants[2], Kind: "mail", Key: "e0001"})
	require.NoError(t, err)
	want2, _ := m.Pick(tenants[2])
	require.Equal(t, want2.Name, e.Shard)
	found, err := a.Find(ctx, "k0001", admin.FindFilter{})
	require.NoError(t, err)
	require.Len(t, found.Inbox, 3)

	// Release one tenant's inbox group: its shard's failed keys go, the others stay.
	gs, err := a.ListGroups(ctx, admin.GroupFilter{Source: admin.SourceInbox, Tenant: &tenants[0]}, admin.Page{})
	require.NoError(t, err)
	require.Len(t, gs.Rows, 1)
	g, err := a.Group(ctx, gs.Rows[0].ID, admin.TimeRange{})
	require.NoError(t, err)
	require.Equal(t, int64(2), g.Count)
	_, err = a.ReleaseGroup(ctx, admin.GroupAction{ID: g.ID, Through: g.LastSeen, AtMost: 1, Note: admin.Audit{Why: "test"}})
	require.ErrorIs(t, err, admin.ErrGroupChanged)
	dry, err := a.ReleaseGroup(ctx, admin.GroupAction{ID: g.ID, Through: g.LastSeen, DryRun: true})
	require.NoError(t, err)
	require.Equal(t, int64(2), dry.Rows)
	res, err := a.ReleaseGroup(ctx, admin.GroupAction{ID: g.ID, Through: g.LastSeen, AtMost: dry.Rows, Note: admin.Audit{Why: "test"}})
	require.NoError(t, err)
	s0, _ := m.Pick(tenants[0])
	require.Equal(t, map[string]int64{s0.Name: 2}, res.Shards)
	st, err = a.Stats(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(4), st.Consumers[0].Failed)
	acts, err := a.ListActions(ctx, admin.ActionFilter{}, admin.Page{})
	require.NoError(t, err)
	require.Len(t, acts.Rows, 1, "the shards without the group record no action")
	require.Equal(t, s0.Name, acts.Rows[0].Shard)
	for _, s := range m.Shards {
		failed, released := 2.0, 0.0
		if s.Name == s0.Name {
			failed, released = 0, 2
		}
		require.Equal(t, failed, metric("idem_inbox_failed_keys", "consumer", "fail-orders", s.Name), "failed keys on %s", s.Name)
		require.Equal(t, released, metric("idem_failures_repaired_total", "action", "release", s.Name), "released on %s", s.Name)
	}

	// Forget and Requeue find the row on its shard.
	k1, _ := m.Pick(tenants[1])
	fk, err := a.Forget(ctx, inbox.ID{Consumer: "orders", Tenant: tenants[1], Key: "k0003"}, admin.Audit{Why: "test"})
	require.NoError(t, err)
	require.Equal(t, k1.Name, fk.Shard)
	require.Zero(t, pgtest.ShardCount(t, k1, `SELECT count(*) FROM inbox WHERE tenant = $1 AND key = 'k0003'`, tenants[1]))
	_, err = a.Forget(ctx, inbox.ID{Consumer: "orders", Tenant: tenants[1], Key: "k0003"}, admin.Audit{Why: "test"})
	require.ErrorIs(t, err, admin.ErrNotFound)
	require.NoError(t, a.Requeue(ctx, admin.EffectID{Tenant: tenants[2], Kind: "dead-mail", Key: "d1"}))
	require.Equal(t, 1, pgtest.ShardCount(t, want2, `SELECT count(*) FROM effects WHERE key = 'd1' AND state = 'pending'`))
	require.ErrorIs(t, a.Requeue(ctx, admin.EffectID{Tenant: tenants[2], Kind: "dead-mail", Key: "d1"}), admin.ErrNotDead)
	require.ErrorIs(t, a.Requeue(ctx, admin.EffectID{Tenant: tenants[2], Kind: "dead-mail", Key: "nope"}), admin.ErrNotFound)
	n, err := a.RequeueDead(ctx, effectsdb.RequeueFilter{Kind: "dead-mail"})
	require.NoError(t, err)
	require.EqualValues(t, 5, n, "the dead effects of every shard")

	// Cursors: a single database's is not a shard map's.
	single, err := a.ListInbox(ctx, admin.InboxFilter{}, admin.Page{Limit: 1})
	require.NoError(t, err)
	_, err = a.ListEffects(ctx, admin.EffectFilter{}, admin.Page{After: single.Next})
	require.ErrorIs(t, err, admin.ErrBadCursor)
}

func clearTimes(cs []admin.ConsumerStats) []admin.ConsumerStats {
	for i := range cs {
		cs[i].Oldest, cs[i].OldestProcessingSeconds = nil, 0
	}
	return cs
}

// TestShardsOneDown: with one shard cluster crashed (pg_ctl stop -m immediate), a
// list fails with a shard_unavailable error naming it, never a page without its
// rows; Stats returns the others' figures, the shard marked down, with that error;
// a key on a shard that answers is still found. After the restart all is read.
func TestShardsOneDown(t *testing.T) {
	m, ctl := pgtest.CrashableShards(t)
	a, err := admin.New(admin.Config{Shards: m})
	require.NoError(t, err)
	ctx := context.Background()
	var up, down string
	for i := 0; up == "" || down == ""; i++ {
		tenant := fmt.Sprintf("v%d", i)
		s, _ := m.Pick(tenant)
		switch {
		case s.Name == "s2" && down == "":
			down = tenant
		case s.Name == "s1" && up == "":
			up = tenant
		default:
			continue
		}
		seedShard(t, m, tenant, "orders", "mail", 3, 0)
	}
	ctl.Crash(1)
	deadline, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	_, err = a.ListInbox(deadline, admin.InboxFilter{}, admin.Page{})
	require.ErrorIs(t, err, admin.ErrShardUnavailable)
	require.Equal(t, "shard_unavailable", errcode.Code(err))
	require.Contains(t, err.Error(), `shard "s2"`)
	_, err = a.ListEffects(deadline, admin.EffectFilter{}, admin.Page{})
	require.ErrorIs(t, err, admin.ErrShardUnavailable)
	_, err = a.ListGroups(deadline, admin.GroupFilter{}, admin.Page{})
	require.ErrorIs(t, err, admin.ErrShardUnavailable)

	st, err := a.Stats(deadline)
	require.ErrorIs(t, err, admin.ErrShardUnavailable)
	require.NotNil(t, st)
	require.False(t, st.Shards[1].Up())
	require.True(t, st.Shards[0].Up())
	require.Equal(t, int64(3), st.Consumers[0].Rows, "the shard that answered is counted")

	k, err := a.InspectInbox(deadline, inbox.ID{Consumer: "orders", Tenant: up, Key: "k0001"}, admin.InspectOptions{})
	require.NoError(t, err)
	require.Equal(t, "s1", k.Shard)
	_, err = a.InspectInbox(deadline, inbox.ID{Consumer: "orders", Tenant: down, Key: "k0001"}, admin.InspectOptions{})
	require.ErrorIs(t, err, admin.ErrShardUnavailable, "not found is never said while a shard did not answer")

	ctl.Start(1)
	require.Eventually(t, func() bool {
		p, err := a.ListInbox(ctx, admin.InboxFilter{}, admin.Page{})
		return err == nil && len(p.Rows) == 6
	}, 30*time.Second, 100*time.Millisecond)
}

// failOn records n failed inbox keys of consumer "orders" and tenant with one
// error text (one failure group) on shard s, whatever the route says (as after a
// tenant moved), failed at, at+1s, ...
func failOn(t *testing.T, s shard.Shard, tenant string, n int, at time.Time) {
	t.Helper()
	failOnCode(t, s, tenant, "handler", s.Name, n, at)
}

// failOnCode is failOn with the failures' error code (a code is part of the
// group: two codes are two groups) and their keys' prefix.
func failOnCode(t *testing.T, s shard.Shard, tenant, code, prefix string, n int, at time.Time) {
	t.Helper()
	_, err := s.Pool.Exec(context.Background(), `INSERT INTO inbox (consumer, tenant, key, fingerprint, state, expires_at, completed_at, error_code, error)
		SELECT 'orders', $1, $2 || '-' || g, '\x00', 'failed', now() + interval '1 day', $3::timestamptz + g * interval '1 second', $5, 'order ' || g || ' refused'
		FROM generate_series(1, $4) g`, tenant, prefix, at, n, code)
	require.NoError(t, err)
}

// TestShardsFailureGroupsMerged: a failure group whose failures are on two shards
// is one row of the list, whatever the page size and order: its counts summed,
// its earliest first and latest last failure, the shards that hold it and each
// one's part; paging by count places it by its sum. Group shows the same parts.
func TestShardsFailureGroupsMerged(t *testing.T) {
	t.Parallel()
	m := pgtest.Shards(t)
	a, err := admin.New(admin.Config{Shards: m})
	require.NoError(t, err)
	ctx := context.Background()
	t0 := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
	// acme: 3 on s1 and 4 on s2 (7 in all, the largest, though neither part is);
	// b: 6 on s1; solo: 5 on s3; c: 2 on s2.
	failOn(t, m.Shards[0], "acme", 3, t0.Add(10*time.Minute))
	failOn(t, m.Shards[1], "acme", 4, t0)
	failOn(t, m.Shards[0], "b", 6, t0.Add(20*time.Minute))
	failOn(t, m.Shards[2], "solo", 5, t0.Add(30*time.Minute))
	failOn(t, m.Shards[1], "c", 2, t0.Add(40*time.Minute))

	byTenant := map[string]admin.FailureGroup{}
	for _, order := range []string{admin.ByCount, admin.ByRecent} {
		want := map[string][]string{
			admin.ByCount:  {"acme", "b", "solo", "c"},
			admin.ByRecent: {"c", "solo", "b", "acme"},
		}[order]
		for _, limit := range []int{1, 2, 3, 10} {
			var got []string
			after := ""
			for pages := 0; ; pages++ {
				require.Less(t, pages, 10)
				pg, err := a.ListGroups(ctx, admin.GroupFilter{Order: order}, admin.Page{Limit: limit, After: after})
				require.NoError(t, err)
				require.LessOrEqual(t, len(pg.Rows), limit)
				for _, g := range pg.Rows {
					got = append(got, g.Tenant)
					byTenant[g.Tenant] = g
				}
				if pg.Next == "" {
					break
				}
				after = pg.Next
			}
			require.Equal(t, want, got, "order %s, %d a page: each group once, in its merged order", order, limit)
		}
	}
	acme := byTenant["acme"]
	require.Equal(t, int64(7), acme.Count)
	require.Equal(t, "s1,s2", acme.Shard)
	require.True(t, acme.FirstSeen.Equal(t0.Add(time.Second)), "the earliest failure, on s2: %v", acme.FirstSeen)
	require.True(t, acme.LastSeen.Equal(t0.Add(10*time.Minute+3*time.Second)), "the latest failure, on s1: %v", acme.LastSeen)
	require.Equal(t, []string{"s1", "s2"}, []string{acme.Parts[0].Shard, acme.Parts[1].Shard})
	require.Equal(t, []int64{3, 4}, []int64{acme.Parts[0].Count, acme.Parts[1].Count})
	require.Len(t, acme.SampleKeys, admin.ListSamples)
	require.Equal(t, "s1-3", acme.SampleKeys[0], "the latest part's keys first")
	solo := byTenant["solo"]
	require.Equal(t, "s3", solo.Shard)
	require.Equal(t, []struct {
		Shard     string    `json:"shard"`
		Count     int64     `json:"count"`
		FirstSeen time.Time `json:"first_seen"`
		LastSeen  time.Time `json:"last_seen"`
	}{{Shard: "s3", Count: 5, FirstSeen: solo.FirstSeen, LastSeen: solo.LastSeen}}, solo.Parts)

	g, err := a.Group(ctx, acme.ID, admin.TimeRange{})
	require.NoError(t, err)
	require.Equal(t, int64(7), g.Count)
	require.Equal(t, acme.Parts, g.Parts)
	require.Equal(t, "s1,s2", g.Shard)
	require.Len(t, g.SampleKeys, 7)

	// The time range counts only the failures in it, on every shard: acme's s2
	// part is before it.
	pg, err := a.ListGroups(ctx, admin.GroupFilter{Seen: admin.TimeRange{Since: t0.Add(5 * time.Minute)}, Tenant: &acme.Tenant}, admin.Page{})
	require.NoError(t, err)
	require.Len(t, pg.Rows, 1)
	require.Equal(t, int64(3), pg.Rows[0].Count)
	require.Equal(t, "s1", pg.Rows[0].Shard)

	_, err = a.ListGroups(ctx, admin.GroupFilter{Order: admin.ByRecent}, admin.Page{Limit: 1, After: func() string {
		pg, err := a.ListGroups(ctx, admin.GroupFilter{}, admin.Page{Limit: 1})
		require.NoError(t, err)
		return pg.Next
	}()})
	require.ErrorIs(t, err, admin.ErrBadCursor, "a cursor of the count order in the recent order")
	// The filter and page are checked as on one database.
	for what, bad := range map[string]struct {
		f admin.GroupFilter
		p admin.Page
	}{
		"source": {admin.GroupFilter{Source: "queue"}, admin.Page{}},
		"order":  {admin.GroupFilter{Order: "size"}, admin.Page{}},
		"limit":  {admin.GroupFilter{}, admin.Page{Limit: admin.MaxLimit + 1}},
	} {
		_, err = a.ListGroups(ctx, bad.f, bad.p)
		require.ErrorIs(t, err, admin.ErrBadFilter, what)
	}
}

// TestShardsFailureGroupsByCode: over a shard map the code filter keeps exactly
// the groups of that code, merged across the shards that hold them, and paging
// the filtered list with small pages visits each of them once, in order.
func TestShardsFailureGroupsByCode(t *testing.T) {
	t.Parallel()
	m := pgtest.Shards(t)
	a, err := admin.New(admin.Config{Shards: m})
	require.NoError(t, err)
	ctx := context.Background()
	t0 := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
	// Each tenant has a payment_declined group and a bad_payload group; acme's
	// declined group is on two shards (3 + 4).
	failOnCode(t, m.Shards[0], "acme", "payment_declined", "s1-d", 3, t0.Add(10*time.Minute))
	failOnCode(t, m.Shards[1], "acme", "payment_declined", "s2-d", 4, t0)
	failOnCode(t, m.Shards[0], "acme", "bad_payload", "s1-b", 9, t0.Add(15*time.Minute))
	failOnCode(t, m.Shards[0], "b", "payment_declined", "s1-d", 6, t0.Add(20*time.Minute))
	failOnCode(t, m.Shards[0], "b", "bad_payload", "s1-b", 1, t0.Add(25*time.Minute))
	failOnCode(t, m.Shards[2], "solo", "payment_declined", "s3-d", 5, t0.Add(30*time.Minute))
	failOnCode(t, m.Shards[2], "solo", "bad_payload", "s3-b", 8, t0.Add(35*time.Minute))
	failOnCode(t, m.Shards[1], "c", "payment_declined", "s2-d", 2, t0.Add(40*time.Minute))
	failOnCode(t, m.Shards[1], "c", "bad_payload", "s2-b", 7, t0.Add(45*time.Minute))

	for _, code := range []string{"payment_declined", "bad_payload"} {
		for _, order := range []string{admin.ByCount, admin.ByRecent} {
			want := map[string]map[string][]string{
				"payment_declined": {admin.ByCount: {"acme", "b", "solo", "c"}, admin.ByRecent: {"c", "solo", "b", "acme"}},
				"bad_payload":      {admin.ByCount: {"acme", "solo", "c", "b"}, admin.ByRecent: {"c", "solo", "b", "acme"}},
			}[code][order]
			for _, limit := range []int{1, 3, 10} {
				var got []string
				after := ""
				for pages := 0; ; pages++ {
					require.Less(t, pages, 10)
					pg, err := a.ListGroups(ctx, admin.GroupFilter{Code: code, Order: order}, admin.Page{Limit: limit, After: after})
					require.NoError(t, err)
					require.LessOrEqual(t, len(pg.Rows), limit)
					for _, g := range pg.Rows {
						require.Equal(t, code, g.Code)
						got = append(got, g.Tenant)
						if code == "payment_declined" && g.Tenant == "acme" {
							require.Equal(t, int64(7), g.Count, "merged across s1 and s2")
							require.Equal(t, "s1,s2", g.Shard)
						}
					}
					if pg.Next == "" {
						break
					}
					after = pg.Next
				}
				require.Equal(t, want, got, "code %s, order %s, %d a page: each group of the code once, in order", code, order, limit)
			}
		}
	}
	all, err := a.ListGroups(ctx, admin.GroupFilter{}, admin.Page{})
	require.NoError(t, err)
	require.Len(t, all.Rows, 8, "without a code, both codes' groups")
	none, err := a.ListGroups(ctx, admin.GroupFilter{Code: "handler"}, admin.Page{})
	require.NoError(t, err)
	require.Empty(t, none.Rows)
	_, err = a.ListGroups(ctx, admin.GroupFilter{Code: "bad\x00code"}, admin.Page{})
	require.ErrorIs(t, err, admin.ErrBadFilter, "checked as on one database")
}

// queryCounter counts the statements run on a pool whose SQL holds sql.
type queryCounter struct {
	sql string
	n   atomic.Int64
}

func (c *queryCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, c.sql) {
		c.n.Add(1)
	}
	return ctx
}

func (c *queryCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// tracedFirstShard is m with its first shard's pool replaced by one traced by c.
func tracedFirstShard(t *testing.T, m *shard.Map, c *queryCounter) *shard.Map {
	t.Helper()
	cfg := m.Shards[0].Pool.Config()
	cfg.ConnConfig.Tracer = c
	traced, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(traced.Close)
	return &shard.Map{Shards: append([]shard.Shard{{Name: m.Shards[0].Name, Pool: traced, Schema: m.Shards[0].Schema}}, m.Shards[1:]...)}
}

// TestShardsFailureGroupsOneAggregateAShard: a merged page of groups reads each
// shard's groups with one aggregate of its failures, however many groups the
// shard holds (past MaxLimit too), so a group is counted once, in one snapshot.
func TestShardsFailureGroupsOneAggregateAShard(t *testing.T) {
	t.Parallel()
	m := pgtest.Shards(t)
	ctx := context.Background()
	counter := &queryCounter{sql: "GROUP BY i.error_group"} // the groups list's aggregate
	tm := tracedFirstShard(t, m, counter)
	a, err := admin.New(admin.Config{Shards: tm})
	require.NoError(t, err)
	// MaxLimit+1 groups on the first shard: one failed key of each tenant.
	groups := admin.MaxLimit + 1
	_, err = tm.Shards[0].Pool.Exec(ctx, `INSERT INTO inbox (consumer, tenant, key, fingerprint, state, expires_at, completed_at,
			error_code, error, error_masked, error_group)
		SELECT 'orders', 't' || g, 'k', '\x00', 'failed', now() + interval '1 day', now(), 'handler', 'refused', 'refused',
			decode(lpad(to_hex(g), 16, '0'), 'hex')
		FROM generate_series(1, $1) g`, groups)
	require.NoError(t, err)
	failOn(t, m.Shards[1], "acme", 2, time.Now().Add(-time.Hour))

	before := counter.n.Load()
	pg, err := a.ListGroups(ctx, admin.GroupFilter{}, admin.Page{Limit: 5})
	require.NoError(t, err)
	require.Equal(t, int64(1), counter.n.Load()-before, "the first shard's groups read with one aggregate")
	require.Len(t, pg.Rows, 5)
	require.Equal(t, "acme", pg.Rows[0].Tenant, "the largest group, on the second shard")
	require.NotEmpty(t, pg.Next)
}

// sampleTracer records, for each statement on a pool that reads failure groups'
// sample keys, how many groups it reads them for: the length of its array of
// groups, or -1 for a statement that reads them for every group it aggregates.
type sampleTracer struct {
	mu     sync.Mutex
	groups []int
}

func (c *sampleTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, "array_agg(x.key") {
		n := -1
		if len(d.Args) > 1 {
			if hashes, ok := d.Args[1].([][]byte); ok {
				n = len(hashes)
			}
		}
		c.mu.Lock()
		c.groups = append(c.groups, n)
		c.mu.Unlock()
	}
	return ctx
}

func (c *sampleTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TestShardsFailureGroupsSamplesThePageOnly: a merged page of groups reads the
// codes, texts and sample keys of the page's groups alone, on the shards that
// hold them, not of every group the shards aggregated for the merge; and a group
// on two shards gets each part's samples.
func TestShardsFailureGroupsSamplesThePageOnly(t *testing.T) {
	t.Parallel()
	m := pgtest.Shards(t)
	ctx := context.Background()
	tracer := &sampleTracer{}
	cfg := m.Shards[0].Pool.Config()
	cfg.ConnConfig.Tracer = tracer
	traced, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(traced.Close)
	tm := &shard.Map{Shards: append([]shard.Shard{{Name: m.Shards[0].Name, Pool: traced, Schema: m.Shards[0].Schema}}, m.Shards[1:]...)}
	a, err := admin.New(admin.Config{Shards: tm})
	require.NoError(t, err)
	// 200 groups of one failure on the first shard, and acme's group on the first
	// two: 2 + 2 failures, the largest.
	t0 := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
	for i := range 200 {
		failOnCode(t, m.Shards[0], fmt.Sprintf("t%03d", i), "handler", "k", 1, t0)
	}
	failOn(t, m.Shards[0], "acme", 2, t0.Add(time.Minute))
	failOn(t, m.Shards[1], "acme", 2, t0)

	pg, err := a.ListGroups(ctx, admin.GroupFilter{}, admin.Page{Limit: 5})
	require.NoError(t, err)
	require.Len(t, pg.Rows, 5)
	require.Equal(t, []int{5}, tracer.groups, "the first shard read samples once, for its 5 groups on the page")
	acme := pg.Rows[0]
	require.Equal(t, "acme", acme.Tenant)
	require.Equal(t, int64(4), acme.Count)
	require.Equal(t, "handler", acme.Code)
	require.Equal(t, "order <n> refused", acme.Masked)
	require.Equal(t, "order 2 refused", acme.Example, "the newest failure, on s1")
	require.Equal(t, []string{"s1-2", "s1-1", "s2-2"}, acme.SampleKeys, "the latest part's keys first, then the other's")
	for _, g := range pg.Rows[1:] {
		require.Equal(t, int64(1), g.Count)
		require.Equal(t, "handler", g.Code)
		require.Equal(t, []string{"k-1"}, g.SampleKeys)
	}
}

// TestShardsForgetAuditNamesTheShard: over a shard map whose shards share a
// schema name, the audit line of a Forget names the shard whose row it deleted.
func TestShardsForgetAuditNamesTheShard(t *testing.T) {
	t.Parallel()
	m := pgtest.Shards(t)
	logs := &syncBuffer{}
	a, err := admin.New(admin.Config{Shards: m, Logger: slog.New(slog.NewJSONHandler(logs, nil))})
	require.NoError(t, err)
	ctx := context.Background()
	s, err := m.Pick("acme")
	require.NoError(t, err)
	_, err = s.Pool.Exec(ctx, `INSERT INTO inbox (consumer, tenant, key, fingerprint, state, completed_at, expires_at)
		VALUES ('orders', 'acme', 'k1', '\x00', 'completed', now(), now() + interval '1 day')`)
	require.NoError(t, err)
	_, err = a.Forget(ctx, inbox.ID{Consumer: "orders", Tenant: "acme", Key: "k1"}, admin.Audit{Who: "op", Why: "test"})
	require.NoError(t, err)
	var lines []map[string]any
	for line := range strings.Lines(logs.String()) {
		var rec map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &rec))
		if rec["msg"] == "idem: inbox key forgotten; its next delivery runs the handler again" {
			lines = append(lines, rec)
		}
	}
	require.Len(t, lines, 1, logs.String())
	require.Equal(t, s.Name, lines[0]["shard"], "the shard whose row was deleted: %v", lines[0])
	require.Equal(t, "k1", lines[0]["key"])
}

// TestShardsGroupActionsAtOnce: two operators acting on one group at the same
// moment over a shard map (each taking a transaction on every shard, one after
// the other) both finish, and each effect is changed by one of them. A group's
// rows are all on its tenant's shard (an action refuses rows elsewhere,
// TestShardsActionsRefuseOffRoute), so the other shards' transactions find none.
func TestShardsGroupActionsAtOnce(t *testing.T) {
	t.Parallel()
	m := pgtest.Shards(t)
	routed, err := m.Pick("acme")
	require.NoError(t, err)
	a, err := admin.New(admin.Config{Shards: m})
	require.NoError(t, err)
	const n = 6000
	for trial := range 8 {
		at := time.Now().UTC()
		_, err := routed.Pool.Exec(context.Background(), `INSERT INTO effects (tenant, kind, key, fingerprint, state, attempts,
				last_error, error_code, error_masked, error_group, dead_at)
			SELECT 'acme', 'mail', $1 || '-' || g, '\x00', 'dead', 3, 'refused', 'provider', 'refused', '\x0102030405060708', $2
			FROM generate_series(1, $3) g`, fmt.Sprintf("t%d", trial), at, n)
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		var wg sync.WaitGroup
		var rows [2]int64
		var errs [2]error
		start := make(chan struct{})
		for i, act := range []func(context.Context, admin.GroupAction) (*admin.ActionResult, error){a.RetryGroup, a.DiscardGroup} {
			wg.Go(func() {
				<-start
				res, err := act(ctx, admin.GroupAction{ID: "e-0102030405060708", Through: at, Note: admin.Audit{Who: "op", Why: "at once"}})
				if errs[i] = err; err == nil {
					rows[i] = res.Rows
				}
			})
		}
		close(start)
		wg.Wait()
		cancel()
		require.NoError(t, errs[0], "trial %d: retry", trial)
		require.NoError(t, errs[1], "trial %d: discard", trial)
		require.Equal(t, int64(n), rows[0]+rows[1], "trial %d: each effect changed once", trial)
		require.Equal(t, 0, pgtest.ShardCount(t, routed, `SELECT count(*) FROM effects WHERE state = 'dead'`), "trial %d", trial)
	}
}

// TestShardsGroupReadsActionsOnce: Group over a shard map reads each shard's
// repair actions on the group once (the merged list), not once more for each
// shard's part that it then drops.
func TestShardsGroupReadsActionsOnce(t *testing.T) {
	t.Parallel()
	m := pgtest.Shards(t)
	ctx := context.Background()
	counter := &queryCounter{sql: "ORDER BY at DESC, id DESC LIMIT"} // the actions list
	tm := tracedFirstShard(t, m, counter)
	a, err := admin.New(admin.Config{Shards: tm})
	require.NoError(t, err)
	t0 := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
	failOn(t, m.Shards[0], "acme", 3, t0)
	failOn(t, m.Shards[1], "acme", 2, t0)
	pg, err := a.ListGroups(ctx, admin.GroupFilter{}, admin.Page{})
	require.NoError(t, err)
	require.Len(t, pg.Rows, 1, "one group on two shards")
	g := pg.Rows[0]
	// The map refuses to act on acme's rows off its route: release each shard's
	// first failure through an Admin of that database alone.
	for _, s := range m.Shards[:2] {
		one, err := admin.New(admin.Config{Pool: s.Pool, Schema: s.Schema})
		require.NoError(t, err)
		_, err = one.ReleaseGroup(ctx, admin.GroupAction{ID: g.ID, Through: t0.Add(time.Second), Note: admin.Audit{Who: "op", Why: "one"}})
		require.NoError(t, err)
	}

	before := counter.n.Load()
	got, err := a.Group(ctx, g.ID, admin.TimeRange{})
	require.NoError(t, err)
	require.Equal(t, int64(1), counter.n.Load()-before, "the first shard's actions read once")
	require.Len(t, got.Actions, 2, "the release's action on each shard")
	require.Equal(t, g.Count-2, got.Count, "the first failure of each shard released")
}
