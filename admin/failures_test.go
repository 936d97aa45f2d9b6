package admin_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/httpidem"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/pgtest"
)

// failKeys records n failed inbox keys of consumer through the inbox store, the
// writer every consumer mode uses, with errors made by msg from the key's number.
func (b *testBundle) failKeys(t *testing.T, consumer, tenant, prefix, code string, n int, msg func(i int) string) {
	t.Helper()
	ctx := context.Background()
	store, err := inboxdb.NewStore(b.schema)
	require.NoError(t, err)
	for i := range n {
		err := pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
			_, err := store.FailTx(ctx, tx, inboxdb.Claim{ID: inboxdb.ID{Consumer: consumer, Tenant: tenant, Key: fmt.Sprintf("%s%d", prefix, i)},
				Fingerprint: []byte{1}}, code, msg(i))
			return err
		})
		require.NoError(t, err)
	}
}

// killEffects enqueues n effects of kind and runs a Dispatcher whose sender fails
// each permanently with send(key)'s error, until all n are dead.
func (b *testBundle) killEffects(t *testing.T, kind, prefix string, n int, send func(key string) error) {
	t.Helper()
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		for i := range n {
			if _, err := effects.Enqueue(effects.WithScope(ctx, effects.Scope{Schema: b.schema}), tx,
				effects.Effect{Kind: kind, Key: fmt.Sprintf("%s%d", prefix, i), Payload: []byte(`{}`)}); err != nil {
				return err
			}
		}
		return nil
	})
	require.NoError(t, err)
	b.dispatchUntil(t, map[string]effects.Sender{kind: effects.SenderFunc(func(_ context.Context, d effects.Delivery) error {
		return effects.Permanent(send(d.Key))
	})}, `SELECT count(*) = `+fmt.Sprint(n)+` FROM effects WHERE kind = '`+kind+`' AND key LIKE '`+prefix+`%' AND state = 'dead'`)
}

// dispatchUntil runs a Dispatcher with senders until cond (a SELECT of one bool)
// holds, then stops it.
func (b *testBundle) dispatchUntil(t *testing.T, senders map[string]effects.Sender, cond string) {
	t.Helper()
	d, err := effects.NewDispatcher(effects.Config{Pool: b.pool, Schema: b.schema, Senders: senders, PollInterval: 20 * time.Millisecond})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	pgtest.WaitFor(t, 20*time.Second, cond, func() bool {
		var ok bool
		require.NoError(t, b.pool.QueryRow(context.Background(), cond).Scan(&ok))
		return ok
	})
	cancel()
	require.NoError(t, <-done)
}

type codedErr struct{ code, msg string }

func (e *codedErr) Error() string { return e.msg }
func (e *codedErr) Code() string  { return e.code }

func groupsOf(t *testing.T, a *admin.Admin, f admin.GroupFilter) []admin.FailureGroup {
	t.Helper()
	p, err := a.ListGroups(context.Background(), f, admin.Page{})
	require.NoError(t, err)
	return p.Rows
}

// TestFailureGroups: failed keys and dead effects written by the real writers
// group by place, tenant, code and masked text; each group has its counts, times,
// samples, masked text and an example; filters and orders work.
func TestFailureGroups(t *testing.T) {
	a, b := setup(t)
	ctx := context.Background()
	b.failKeys(t, "orders", "", "o", "bad_payload", 5, func(i int) string { return fmt.Sprintf(`order %d: field "amount" is "x%d"`, i, i) })
	b.failKeys(t, "orders", "", "p", "bad_payload", 2, func(i int) string { return "currency not supported" })
	b.failKeys(t, "orders", "acme", "o", "bad_payload", 1, func(i int) string { return fmt.Sprintf("order %d: field \"amount\" is \"y\"", i+100) })
	b.killEffects(t, "email", "r", 3, func(key string) error {
		return &codedErr{code: "provider_rejected", msg: "provider rejected " + key + ": shape 0x1F"}
	})

	all := groupsOf(t, a, admin.GroupFilter{})
	require.Len(t, all, 4)
	require.Equal(t, []int64{5, 3, 2, 1}, []int64{all[0].Count, all[1].Count, all[2].Count, all[3].Count}, "largest first")

	g := all[0]
	require.Equal(t, admin.SourceInbox, g.Source)
	require.Equal(t, "orders", g.Consumer)
	require.Equal(t, "bad_payload", g.Code)
	require.Equal(t, `order <n>: field "…" is "…"`, g.Masked)
	require.Regexp(t, `^i-[0-9a-f]{16}$`, g.ID)
	require.Equal(t, `order 4: field "amount" is "x4"`, g.Example, "the newest failure's whole text")
	require.Equal(t, []string{"o4", "o3", "o2"}, g.SampleKeys, "newest first")
	require.False(t, g.FirstSeen.After(g.LastSeen))

	e := all[1]
	require.Equal(t, admin.SourceEffects, e.Source)
	require.Equal(t, "email", e.Kind)
	require.Equal(t, "provider_rejected", e.Code, "a dead effect keeps its error's code")
	require.Equal(t, "provider rejected r<n>: shape <hex>", e.Masked)
	require.Regexp(t, `^e-[0-9a-f]{16}$`, e.ID)

	// The same failures make the same ID, in a new Admin too.
	a2, err := admin.New(admin.Config{Pool: b.pool, Schema: b.schema})
	require.NoError(t, err)
	require.Equal(t, all, groupsOf(t, a2, admin.GroupFilter{}))

	// Filters.
	require.Len(t, groupsOf(t, a, admin.GroupFilter{Source: admin.SourceEffects}), 1)
	require.Len(t, groupsOf(t, a, admin.GroupFilter{Consumer: "orders"}), 3)
	require.Len(t, groupsOf(t, a, admin.GroupFilter{Kind: "email"}), 1)
	require.Len(t, groupsOf(t, a, admin.GroupFilter{Tenant: ptr("acme")}), 1)
	require.Empty(t, groupsOf(t, a, admin.GroupFilter{Seen: admin.TimeRange{Since: time.Now().Add(time.Hour)}}))
	require.Len(t, groupsOf(t, a, admin.GroupFilter{Seen: admin.TimeRange{Since: time.Now().Add(-time.Hour)}}), 4)
	_, err = a.ListGroups(ctx, admin.GroupFilter{Source: "kafka"}, admin.Page{})
	require.ErrorIs(t, err, admin.ErrBadFilter)
	_, err = a.ListGroups(ctx, admin.GroupFilter{Order: "size"}, admin.Page{})
	require.ErrorIs(t, err, admin.ErrBadFilter)

	// By recency: the effects died last.
	recent := groupsOf(t, a, admin.GroupFilter{Order: admin.ByRecent})
	require.Equal(t, e.ID, recent[0].ID)

	// Keyset paging, one group a page, in both orders, visits each group once.
	for _, order := range []string{admin.ByCount, admin.ByRecent} {
		var ids []string
		page := admin.Page{Limit: 1}
		for {
			p, err := a.ListGroups(ctx, admin.GroupFilter{Order: order}, page)
			require.NoError(t, err)
			for _, g := range p.Rows {
				ids = append(ids, g.ID)
			}
			if p.Next == "" {
				break
			}
			page.After = p.Next
		}
		want := groupsOf(t, a, admin.GroupFilter{Order: order})
		require.Len(t, ids, len(want))
		for i := range want {
			require.Equal(t, want[i].ID, ids[i], order)
		}
	}
	p, err := a.ListGroups(ctx, admin.GroupFilter{}, admin.Page{Limit: 1})
	require.NoError(t, err)
	_, err = a.ListGroups(ctx, admin.GroupFilter{Order: admin.ByRecent}, admin.Page{Limit: 1, After: p.Next})
	require.ErrorIs(t, err, admin.ErrBadCursor)

	// Show: more samples, the attempts of an effects group.
	shown, err := a.Group(ctx, e.ID, admin.TimeRange{})
	require.NoError(t, err)
	require.Equal(t, int64(3), shown.Count)
	require.Len(t, shown.SampleKeys, 3)
	require.Equal(t, []struct {
		Attempts int   `json:"attempts"`
		Effects  int64 `json:"effects"`
	}{{Attempts: 1, Effects: 3}}, shown.Attempts)
	_, err = a.Group(ctx, "e-0000000000000000", admin.TimeRange{})
	require.ErrorIs(t, err, admin.ErrNotFound)
	_, err = a.Group(ctx, "x-00", admin.TimeRange{})
	require.ErrorIs(t, err, admin.ErrBadFilter)
}

// TestFailureGroupsByCode: the code filter keeps exactly the groups of that code,
// inbox and effects, with the other filters too; a code a handler made up (any
// text) is found; paging the filtered list a group a page visits each of its
// groups once; a code no failure can have is bad_filter.
func TestFailureGroupsByCode(t *testing.T) {
	a, b := setup(t)
	ctx := context.Background()
	custom := "Card declined (issuer 05) / " + strings.Repeat("x", 300)
	b.failKeys(t, "orders", "", "d", "payment_declined", 4, func(i int) string { return fmt.Sprintf("card %d declined", i) })
	b.failKeys(t, "orders", "acme", "d", "payment_declined", 2, func(i int) string { return fmt.Sprintf("card %d declined", i) })
	b.failKeys(t, "orders", "", "l", "payment_declined", 1, func(i int) string { return "limit reached" })
	b.failKeys(t, "orders", "", "b", "bad_payload", 5, func(i int) string { return fmt.Sprintf("card %d declined", i) })
	b.failKeys(t, "orders", "acme", "b", "bad_payload", 3, func(i int) string { return "no amount" })
	b.failKeys(t, "refunds", "", "c", custom, 2, func(i int) string { return "declined" })
	b.failKeys(t, "refunds", "", "n", "", 1, func(i int) string { return "no code" })
	b.killEffects(t, "charge", "x", 3, func(key string) error { return &codedErr{code: "payment_declined", msg: "charge " + key + " declined"} })
	b.killEffects(t, "email", "y", 2, func(key string) error { return &codedErr{code: "bad_payload", msg: "email " + key + " refused"} })

	all := groupsOf(t, a, admin.GroupFilter{})
	require.Len(t, all, 9)
	of := func(code string, keep func(g admin.FailureGroup) bool) []string {
		var ids []string
		for _, g := range all {
			if g.Code == code && keep(g) {
				ids = append(ids, g.ID)
			}
		}
		return ids
	}
	ids := func(gs []admin.FailureGroup) []string {
		var out []string
		for _, g := range gs {
			out = append(out, g.ID)
		}
		return out
	}
	every := func(admin.FailureGroup) bool { return true }
	declined := of("payment_declined", every)
	require.Len(t, declined, 4, "3 inbox groups and 1 effects group")
	require.Equal(t, declined, ids(groupsOf(t, a, admin.GroupFilter{Code: "payment_declined"})))
	require.Equal(t, of("bad_payload", every), ids(groupsOf(t, a, admin.GroupFilter{Code: "bad_payload"})))
	require.Len(t, of("bad_payload", every), 3)
	require.Equal(t, of(custom, every), ids(groupsOf(t, a, admin.GroupFilter{Code: custom})), "a handler's own code, whatever its text")
	require.Len(t, of(custom, every), 1)
	require.Len(t, of("", every), 1, "a code-less failure's group is listed without a code filter")
	require.Empty(t, groupsOf(t, a, admin.GroupFilter{Code: "PAYMENT_DECLINED"}), "an exact match")
	require.Empty(t, groupsOf(t, a, admin.GroupFilter{Code: "payment"}), "an exact match")

	// With the other filters.
	require.Equal(t, of("payment_declined", func(g admin.FailureGroup) bool { return g.Source == admin.SourceInbox }),
		ids(groupsOf(t, a, admin.GroupFilter{Code: "payment_declined", Consumer: "orders"})))
	require.Equal(t, of("payment_declined", func(g admin.FailureGroup) bool { return g.Source == admin.SourceEffects }),
		ids(groupsOf(t, a, admin.GroupFilter{Code: "payment_declined", Source: admin.SourceEffects})))
	require.Equal(t, of("bad_payload", func(g admin.FailureGroup) bool { return g.Tenant == "acme" }),
		ids(groupsOf(t, a, admin.GroupFilter{Code: "bad_payload", Tenant: ptr("acme")})))
	require.Empty(t, groupsOf(t, a, admin.GroupFilter{Code: "payment_declined", Seen: admin.TimeRange{Since: time.Now().Add(time.Hour)}}))

	// Paging the filtered list one group a page, in both orders: no gap, no
	// duplicate, the unpaged filtered order.
	for _, order := range []string{admin.ByCount, admin.ByRecent} {
		var got []string
		page := admin.Page{Limit: 1}
		for pages := 0; ; pages++ {
			require.Less(t, pages, 10)
			p, err := a.ListGroups(ctx, admin.GroupFilter{Code: "payment_declined", Order: order}, page)
			require.NoError(t, err)
			got = append(got, ids(p.Rows)...)
			if p.Next == "" {
				break
			}
			page.After = p.Next
		}
		want := ids(groupsOf(t, a, admin.GroupFilter{Code: "payment_declined", Order: order}))
		require.Len(t, want, 4)
		require.Equal(t, want, got, order)
	}

	for _, bad := range []string{"bad\x00code", "\xff\xfe"} {
		_, err := a.ListGroups(ctx, admin.GroupFilter{Code: bad}, admin.Page{})
		require.ErrorIs(t, err, admin.ErrBadFilter, "%q", bad)
		// The other text filters too: bad_filter, not a database error.
		for _, f := range []admin.GroupFilter{{Consumer: bad}, {Kind: bad}, {Tenant: &bad}} {
			_, err := a.ListGroups(ctx, f, admin.Page{})
			require.ErrorIs(t, err, admin.ErrBadFilter, "%+v", f)
		}
	}
}

// TestFailureGroupActions: a dry run says exactly what an action would touch and
// changes nothing; an action needs a note, changes only the rows up to its
// Through bound, is stored with its note, and repeating it changes nothing more.
func TestFailureGroupActions(t *testing.T) {
	a, b := setup(t)
	ctx := context.Background()
	b.killEffects(t, "email", "r", 4, func(key string) error { return errors.New("rejected " + key) })
	b.failKeys(t, "orders", "", "o", "bad_payload", 3, func(i int) string { return fmt.Sprint("order ", i, " invalid") })
	groups := groupsOf(t, a, admin.GroupFilter{})
	require.Len(t, groups, 2)
	eg, ig := groups[0], groups[1]
	require.Equal(t, admin.SourceEffects, eg.Source)

	// Wrong source, missing bound, missing note.
	_, err := a.ReleaseGroup(ctx, admin.GroupAction{ID: eg.ID, Through: eg.LastSeen, Note: admin.Audit{Why: "x"}})
	require.ErrorIs(t, err, admin.ErrWrongSource)
	_, err = a.RetryGroup(ctx, admin.GroupAction{ID: ig.ID, Through: ig.LastSeen, Note: admin.Audit{Why: "x"}})
	require.ErrorIs(t, err, admin.ErrWrongSource)
	_, err = a.RetryGroup(ctx, admin.GroupAction{ID: eg.ID, Note: admin.Audit{Why: "x"}})
	require.ErrorIs(t, err, admin.ErrBadFilter)
	_, err = a.RetryGroup(ctx, admin.GroupAction{ID: eg.ID, Through: eg.LastSeen})
	require.ErrorIs(t, err, admin.ErrNoteRequired)

	// A failure of the same group that arrives after the look is not swept in.
	b.exec(t, `UPDATE effects SET dead_at = now() + interval '1 minute' WHERE key = 'r3'`)

	plan, err := a.RetryGroup(ctx, admin.GroupAction{ID: eg.ID, Through: eg.LastSeen, DryRun: true})
	require.NoError(t, err)
	require.Equal(t, int64(4), eg.Count)
	require.Equal(t, int64(3), plan.Rows)
	require.Equal(t, []string{"r0", "r1", "r2"}, plan.Keys)
	require.Empty(t, plan.ActionID)
	require.Equal(t, 4, countOf(t, b, `SELECT count(*) FROM effects WHERE state = 'dead'`), "a dry run changes nothing")
	require.Equal(t, 0, countOf(t, b, `SELECT count(*) FROM failure_actions`), "a dry run records nothing")

	note := admin.Audit{Who: "alice", Why: "provider fixed the shape check"}
	done, err := a.RetryGroup(ctx, admin.GroupAction{ID: eg.ID, Through: eg.LastSeen, Note: note})
	require.NoError(t, err)
	require.Equal(t, plan.Rows, done.Rows)
	require.Equal(t, plan.Keys, done.Keys)
	require.NotEmpty(t, done.ActionID)
	require.Equal(t, 3, countOf(t, b, `SELECT count(*) FROM effects WHERE state = 'pending' AND attempts = 0 AND next_attempt_at <= now()`))
	require.Equal(t, 1, countOf(t, b, `SELECT count(*) FROM effects WHERE state = 'dead' AND key = 'r3'`))

	again, err := a.RetryGroup(ctx, admin.GroupAction{ID: eg.ID, Through: eg.LastSeen, Note: note})
	require.NoError(t, err)
	require.Zero(t, again.Rows, "repeating the action changes nothing more")

	// A failure whose recording transaction began before the look and committed
	// after it carries a time within the bound: Through alone would take it, and
	// AtMost (the plan's rows) refuses the action instead, changing nothing.
	rplan, err := a.ReleaseGroup(ctx, admin.GroupAction{ID: ig.ID, Through: ig.LastSeen, DryRun: true})
	require.NoError(t, err)
	require.Equal(t, int64(3), rplan.Rows)
	stored := countOf(t, b, `SELECT count(*) FROM failure_actions`)
	b.failKeys(t, "orders", "", "late", "bad_payload", 1, func(int) string { return "order 77 invalid" })
	b.exec(t, `UPDATE inbox SET completed_at = $1 WHERE key = 'late0'`, ig.FirstSeen)
	_, err = a.ReleaseGroup(ctx, admin.GroupAction{ID: ig.ID, Through: ig.LastSeen, AtMost: rplan.Rows, Note: note})
	require.ErrorIs(t, err, admin.ErrGroupChanged)
	require.Equal(t, "group_changed", inbox.Code(err))
	require.Equal(t, 4, countOf(t, b, `SELECT count(*) FROM inbox WHERE state = 'failed'`), "nothing was released")
	require.Equal(t, stored, countOf(t, b, `SELECT count(*) FROM failure_actions`), "nor recorded")
	b.exec(t, `DELETE FROM inbox WHERE key = 'late0'`)

	// Release: the failed keys are gone; discard: the rest of the effects group.
	rel, err := a.ReleaseGroup(ctx, admin.GroupAction{ID: ig.ID, Through: ig.LastSeen, AtMost: rplan.Rows, Note: note})
	require.NoError(t, err)
	require.Equal(t, int64(3), rel.Rows)
	require.Zero(t, countOf(t, b, `SELECT count(*) FROM inbox`))
	dis, err := a.DiscardGroup(ctx, admin.GroupAction{ID: eg.ID, Through: time.Now().Add(time.Hour), Note: admin.Audit{Who: "bob", Why: "obsolete"}})
	require.NoError(t, err)
	require.Equal(t, int64(1), dis.Rows)
	require.Equal(t, 1, countOf(t, b, `SELECT count(*) FROM effects WHERE state = 'discarded' AND key = 'r3' AND done_at IS NOT NULL`))

	// The audit trail, newest first, through the API and per group.
	acts, err := a.ListActions(ctx, admin.ActionFilter{}, admin.Page{})
	require.NoError(t, err)
	require.Len(t, acts.Rows, 4)
	last := acts.Rows[0]
	require.Equal(t, admin.ActionDiscard, last.Action)
	require.Equal(t, "bob", last.Who)
	require.Equal(t, "obsolete", last.Why)
	require.Equal(t, "email", last.Place)
	require.Equal(t, eg.ID, last.Group)
	require.Equal(t, int64(1), last.Rows)
	require.Equal(t, []int64{1, 3, 0, 3}, []int64{acts.Rows[0].Rows, acts.Rows[1].Rows, acts.Rows[2].Rows, acts.Rows[3].Rows})
	perGroup, err := a.ListActions(ctx, admin.ActionFilter{Group: eg.ID}, admin.Page{Limit: 2})
	require.NoError(t, err)
	require.Len(t, perGroup.Rows, 2)
	require.NotEmpty(t, perGroup.Next)
	rest, err := a.ListActions(ctx, admin.ActionFilter{Group: eg.ID}, admin.Page{Limit: 2, After: perGroup.Next})
	require.NoError(t, err)
	require.Len(t, rest.Rows, 1)
	require.Equal(t, admin.ActionRetry, rest.Rows[0].Action)
	require.Empty(t, rest.Next)

	// The discarded effect is never sent.
	var sent atomic.Int64
	b.dispatchUntil(t, map[string]effects.Sender{"email": effects.SenderFunc(func(context.Context, effects.Delivery) error {
		sent.Add(1)
		return nil
	})}, `SELECT count(*) = 3 FROM effects WHERE state = 'done'`)
	require.Equal(t, int64(3), sent.Load())
	require.Equal(t, 1, countOf(t, b, `SELECT count(*) FROM effects WHERE state = 'discarded'`))
}

// TestFailureGroupsBackfill: failures recorded before the group columns existed
// are put in their groups, with the masking the writers use, on the first read.
func TestFailureGroupsBackfill(t *testing.T) {
	a, b := setup(t)
	b.exec(t, `INSERT INTO inbox (consumer, key, fingerprint, state, error_code, error, completed_at, expires_at)
		SELECT 'orders', 'k' || g, '\x01', 'failed', 'bad', 'order ' || g || ' bad', now(), now() + interval '1 day'
		FROM generate_series(1, 2500) g`)
	b.exec(t, `INSERT INTO effects (kind, key, fingerprint, state, last_error, attempts)
		VALUES ('sms', 'a', '\x00', 'dead', 'number 555-0100 unreachable', 25), ('sms', 'b', '\x00', 'dead', 'number 555-0199 unreachable', 25)`)
	// A failure the new writer recorded lands in the same group as the old ones.
	b.failKeys(t, "orders", "", "new", "bad", 1, func(int) string { return "order 9999 bad" })

	groups := groupsOf(t, a, admin.GroupFilter{})
	require.Len(t, groups, 2)
	require.Equal(t, int64(2501), groups[0].Count)
	require.Equal(t, "order <n> bad", groups[0].Masked)
	require.Equal(t, int64(2), groups[1].Count)
	require.Equal(t, "number <n>-<n> unreachable", groups[1].Masked)
	require.Zero(t, countOf(t, b, `SELECT count(*) FROM effects WHERE state = 'dead' AND (error_group IS NULL OR dead_at IS NULL)`))
}

func countOf(t *testing.T, b *testBundle, sql string) int {
	t.Helper()
	var n int
	require.NoError(t, b.pool.QueryRow(context.Background(), sql).Scan(&n))
	return n
}

// TestFailureMetrics: every series exists at 0 before anything failed (the
// configured consumers and kinds, every action), then counts the failures and the
// repairs, whoever made them.
func TestFailureMetrics(t *testing.T) {
	_, b := setup(t)
	ctx := context.Background()
	reg := prometheus.NewRegistry()
	a, err := admin.New(admin.Config{Pool: b.pool, Schema: b.schema, Registerer: reg,
		Consumers: []string{"orders"}, Kinds: []string{"email", "sms"}, MetricsInterval: time.Nanosecond})
	require.NoError(t, err)
	read := func() map[string]float64 {
		mfs, err := reg.Gather()
		require.NoError(t, err)
		out := map[string]float64{}
		for _, mf := range mfs {
			for _, m := range mf.GetMetric() {
				name := mf.GetName() + "{" + m.GetLabel()[0].GetValue() + "}"
				out[name] = m.GetGauge().GetValue() + m.GetCounter().GetValue()
			}
		}
		return out
	}
	require.Equal(t, map[string]float64{
		"idem_inbox_failed_keys{orders}": 0, "idem_effects_dead_rows{email}": 0, "idem_effects_dead_rows{sms}": 0,
		"idem_failures_repaired_total{retry}": 0, "idem_failures_repaired_total{discard}": 0, "idem_failures_repaired_total{release}": 0,
	}, read())

	b.failKeys(t, "orders", "", "o", "bad", 3, func(int) string { return "bad" })
	b.failKeys(t, "billing", "", "o", "bad", 1, func(int) string { return "bad" })
	b.killEffects(t, "email", "r", 2, func(string) error { return errors.New("no") })
	m := read()
	require.Equal(t, 3.0, m["idem_inbox_failed_keys{orders}"])
	require.Equal(t, 1.0, m["idem_inbox_failed_keys{billing}"])
	require.Equal(t, 2.0, m["idem_effects_dead_rows{email}"])

	for _, g := range groupsOf(t, a, admin.GroupFilter{}) {
		act := admin.GroupAction{ID: g.ID, Through: g.LastSeen, Note: admin.Audit{Who: "ops", Why: "fixed"}}
		if g.Source == admin.SourceEffects {
			_, err = a.RetryGroup(ctx, act)
		} else {
			_, err = a.ReleaseGroup(ctx, act)
		}
		require.NoError(t, err)
	}
	m = read()
	require.Equal(t, 0.0, m["idem_inbox_failed_keys{orders}"], "a consumer seen once stays, at 0")
	require.Equal(t, 0.0, m["idem_effects_dead_rows{email}"])
	require.Equal(t, 2.0, m["idem_failures_repaired_total{retry}"])
	require.Equal(t, 4.0, m["idem_failures_repaired_total{release}"])
	require.Equal(t, 0.0, m["idem_failures_repaired_total{discard}"])
}

// TestEveryWriterGroupsFailures: each path that records a failed key (a consumer in
// each mode, httpidem in a transaction and in lease mode) and the Dispatcher's
// dead outcome store the masked text and the group as they write, before anyone
// reads the groups; two failures that differ in their numbers share a group.
func TestEveryWriterGroupsFailures(t *testing.T) {
	a, b := setup(t)
	for _, mode := range []consumer.Mode{consumer.Transactional, consumer.GroupCommit, consumer.Lease} {
		cfg := consumer.Config{Name: "orders-" + mode.String(), Pool: b.pool, Schema: b.schema, Mode: mode}
		if mode != consumer.Lease {
			cfg.Batch.MaxWait = 20 * time.Millisecond
		}
		c, err := consumer.New(cfg)
		require.NoError(t, err)
		h := c.Middleware(func(m *message.Message) ([]*message.Message, error) {
			return nil, consumer.Permanent(fmt.Errorf("order %s refused", m.UUID))
		})
		for _, id := range []string{"1001", "2002"} {
			_, err := h(message.NewMessage(id, []byte(`{}`)))
			require.NoError(t, err, mode)
		}
		require.NoError(t, c.Close())
	}
	mw, err := httpidem.New(httpidem.Config{Pool: b.pool, Schema: b.schema, Unscoped: true})
	require.NoError(t, err)
	refuse := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "no", http.StatusUnprocessableEntity)
	})
	mux := http.NewServeMux()
	mux.Handle("POST /payments", mw.Middleware(refuse))
	mux.Handle("POST /refunds", mw.Route(httpidem.Route{Lease: true})(refuse))
	for _, path := range []string{"/payments", "/refunds"} {
		for _, key := range []string{"k1", "k2"} {
			req := httptest.NewRequest(http.MethodPost, path, strings.NewReader(`{}`))
			req.Header.Set("Idempotency-Key", key)
			rec := httptest.NewRecorder()
			mux.ServeHTTP(rec, req)
			require.Equal(t, http.StatusUnprocessableEntity, rec.Code, rec.Body.String())
		}
	}
	b.killEffects(t, "email", "r", 2, func(key string) error { return errors.New("bounced " + key) })

	require.Equal(t, 10, countOf(t, b, `SELECT count(*) FROM inbox WHERE state = 'failed'`))
	require.Zero(t, countOf(t, b, `SELECT count(*) FROM inbox WHERE state = 'failed' AND (error_group IS NULL OR error_masked IS NULL)`),
		"every writer groups its failures as it records them")
	require.Zero(t, countOf(t, b, `SELECT count(*) FROM effects WHERE state = 'dead' AND (error_group IS NULL OR error_masked IS NULL OR dead_at IS NULL)`))
	groups := groupsOf(t, a, admin.GroupFilter{})
	require.Len(t, groups, 6, "one group per consumer, HTTP operation and kind")
	for _, g := range groups {
		require.Equal(t, int64(2), g.Count, "%s %s", g.Place(), g.Masked)
	}
}
