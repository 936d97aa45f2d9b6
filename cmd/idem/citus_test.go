package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/pgtest"
)

// citusBundle is setup on the Citus coordinator: a schema migrated in Citus mode,
// and the CLI pointed at the coordinator.
func citusBundle(t *testing.T) *bundle {
	t.Helper()
	t.Parallel()
	pool, schema := pgtest.CitusSetup(t, pgtest.Options{MaxConns: 4})
	return &bundle{t: t, pool: pool, schema: schema, url: pgtest.CitusURL(t)}
}

// The built binary repairs failures on Citus: for two tenants of each worker, 2
// failed payments keys each (a real consumer) and 2 dead email effects each (a
// real Dispatcher); it lists and shows the groups, retries one tenant's dead
// effects and releases another's failed keys, lists the stored actions, requeues
// and forgets, finds a key on both workers and reads the stats.
func TestCitusCLI(t *testing.T) {
	b := citusBundle(t)
	w1, w2 := seedCitusFailures(t, b)

	var groups []admin.FailureGroup
	b.bin("failures", "--json").ok(t).decode(t, &groups)
	require.Len(t, groups, 8, "an inbox and an effects group of each tenant")
	byKey := map[string]admin.FailureGroup{}
	for _, g := range groups {
		require.EqualValues(t, 2, g.Count)
		require.Len(t, g.SampleKeys, 2)
		byKey[g.Source+"/"+g.Tenant] = g
	}
	retry, release := byKey["effects/"+w1[0]], byKey["inbox/"+w2[0]]
	var shown admin.FailureGroup
	b.bin("failures", "show", retry.ID, "--json").ok(t).decode(t, &shown)
	// Newest first; the two died in one outcome batch, at one time, in either order.
	require.ElementsMatch(t, []string{"receipt:1", "receipt:0"}, shown.SampleKeys)

	var res admin.ActionResult
	b.bin("failures", "retry", retry.ID, "--note", "INC-7: provider fixed", "--by", "alice",
		"--through", retry.LastSeen.Format(time.RFC3339Nano), "--yes", "--json").ok(t).decode(t, &res)
	require.EqualValues(t, 2, res.Rows)
	require.Equal(t, 2, countRows(t, b, `SELECT count(*) FROM effects WHERE tenant = '`+w1[0]+`' AND state = 'pending' AND attempts = 0`))
	r := b.bin("failures", "release", release.ID, "--note", "deploy 9 fixed it", "--yes").ok(t)
	require.Contains(t, r.stdout, "released 2 failed inbox key(s)")
	require.Zero(t, countRows(t, b, `SELECT count(*) FROM inbox WHERE tenant = '`+w2[0]+`' AND state = 'failed'`))
	require.Equal(t, 6, countRows(t, b, `SELECT count(*) FROM inbox WHERE state = 'failed'`))
	require.Equal(t, 2, countRows(t, b, `SELECT count(*) FROM failure_actions`))
	require.Equal(t, 1, countRows(t, b, `SELECT count(*) FROM failure_actions
		WHERE action = 'retry' AND tenant = '`+w1[0]+`' AND place = 'email' AND affected = 2 AND who = 'alice' AND why = 'INC-7: provider fixed'`))
	r = b.bin("failures", "show", retry.ID).ok(t)
	require.Contains(t, r.stdout, "holds no failures now")
	require.Regexp(t, `retry\s+2\s+\S+\s+alice\s+INC-7: provider fixed`, r.stdout)

	r = b.bin("effects", "requeue", "--kind", "email", "--key", "receipt:0", "--tenant", w2[1]).ok(t)
	require.Contains(t, r.stdout, "requeued 1 dead email effect")
	var out map[string]any
	b.bin("effects", "requeue", "--kind", "email", "--all-dead", "--json").ok(t).decode(t, &out)
	require.EqualValues(t, 5, out["requeued"], "the dead effects left, of both workers")
	require.Zero(t, countRows(t, b, `SELECT count(*) FROM effects WHERE state = 'dead'`))

	b.bin("forget", "--consumer", "payments", "--tenant", w1[1], "--key", "pay_0", "--reason", "card fixed", "--yes").ok(t)
	require.Zero(t, countRows(t, b, `SELECT count(*) FROM inbox WHERE tenant = '`+w1[1]+`' AND key = 'pay_0'`))

	var found admin.Found
	b.bin("find", "--key", "pay_1", "--json").ok(t).decode(t, &found)
	require.Len(t, found.Inbox, 3, "pay_1 of each tenant but the released one, on both workers")

	var st admin.Stats
	b.bin("stats", "--json").ok(t).decode(t, &st)
	require.Len(t, st.Consumers, 1)
	require.EqualValues(t, 5, st.Consumers[0].Failed)
	require.Len(t, st.Effects, 1)
	require.EqualValues(t, 8, st.Effects[0].Pending)
}

// seedCitusFailures writes, for two tenants of each Citus worker (returned), 2
// failed payments keys each (a real consumer) and 2 dead email effects each (a
// real Dispatcher whose sender refuses every one).
func seedCitusFailures(t *testing.T, b *bundle) (w1, w2 []string) {
	t.Helper()
	ctx := context.Background()
	w1, w2 = pgtest.CitusTenants(t, b.pool, b.schema, "t", 2)
	tenants := slices.Sorted(slices.Values(slices.Concat(w1, w2)))
	for _, tenant := range tenants {
		for i := range 2 {
			b.process(tenant, fmt.Sprintf("pay_%d", i), "bad")
		}
		sctx := effects.WithScope(ctx, effects.Scope{Schema: b.schema, Tenant: tenant})
		for i := range 2 {
			_, err := effects.Enqueue(sctx, b.pool, effects.Effect{Kind: "email", Key: fmt.Sprintf("receipt:%d", i), Payload: []byte(`{}`)})
			require.NoError(t, err)
		}
	}
	d, err := effects.NewDispatcher(effects.Config{Pool: b.pool, Schema: b.schema, PollInterval: 20 * time.Millisecond,
		Senders: map[string]effects.Sender{"email": effects.SenderFunc(func(_ context.Context, dl effects.Delivery) error {
			return effects.Permanent(fmt.Errorf("smtp 550: mailbox %q unavailable", dl.Key))
		})}})
	require.NoError(t, err)
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- d.Run(runCtx) }()
	pgtest.WaitFor(t, 30*time.Second, "8 dead effects", func() bool { return countRows(t, b, `SELECT count(*) FROM effects WHERE state = 'dead'`) == 8 })
	stop()
	require.NoError(t, <-done)
	return w1, w2
}

// The console serves Citus: over two tenants of each worker, its API reads the
// stats, the activity, the failure groups of both workers and one group, lists
// and inspects keys and effects, finds a key on both workers, retries one
// tenant's dead effects and requeues another's; the overview and the Failures
// page load in headless Chromium with no JavaScript error.
func TestCitusConsole(t *testing.T) {
	b := citusBundle(t)
	w1, w2 := seedCitusFailures(t, b)
	srv := b.consoleServer(t, false)
	var session sessionJSON
	require.NoError(t, json.Unmarshal(call(t, srv, "GET", "/api/session", "", nil).body, &session))
	token := map[string]string{"X-Idem-Token": session.Token, "Content-Type": "application/json"}
	get := func(path string) []byte {
		t.Helper()
		r := call(t, srv, "GET", path, "", nil)
		require.Equal(t, http.StatusOK, r.status, "%s: %s", path, r.body)
		return r.body
	}

	var st admin.Stats
	require.NoError(t, json.Unmarshal(get("/api/stats"), &st))
	require.EqualValues(t, 8, st.Consumers[0].Failed)
	require.EqualValues(t, 8, st.Effects[0].Dead)
	get("/api/activity?window=hour")
	var groups groupPageJSON
	require.NoError(t, json.Unmarshal(get("/api/failures"), &groups))
	require.Len(t, groups.Groups, 8, "an inbox and an effects group of each tenant")
	var retry admin.FailureGroup
	for _, g := range groups.Groups {
		if g.Source == "effects" && g.Tenant == w1[0] {
			retry = g
		}
	}
	require.NotEmpty(t, retry.ID)
	var shown admin.FailureGroup
	require.NoError(t, json.Unmarshal(get("/api/failures/group?id="+retry.ID), &shown))
	require.Len(t, shown.SampleKeys, 2)
	get("/api/effects?state=dead")
	get("/api/inbox?state=failed")
	get(fmt.Sprintf("/api/inbox/key?consumer=payments&tenant=%s&key=pay_0", w2[0]))
	var found admin.Found
	require.NoError(t, json.Unmarshal(get("/api/find?key=pay_1"), &found))
	require.Len(t, found.Inbox, 4, "pay_1 of each tenant, on both workers")

	r := call(t, srv, "POST", "/api/failures/action", fmt.Sprintf(`{"id":%q,"action":"retry","through":%q,"who":"ann","why":"provider fixed"}`,
		retry.ID, retry.LastSeen.Format(time.RFC3339Nano)), token)
	require.Equal(t, http.StatusOK, r.status, "%s", r.body)
	require.Equal(t, 2, countRows(t, b, `SELECT count(*) FROM effects WHERE tenant = '`+w1[0]+`' AND state = 'pending'`))
	r = call(t, srv, "POST", "/api/requeue", fmt.Sprintf(`{"kind":"email","key":"receipt:0","tenant":%q}`, w2[1]), token)
	require.Equal(t, http.StatusOK, r.status, "%s", r.body)
	require.Equal(t, 1, countRows(t, b, `SELECT count(*) FROM effects WHERE tenant = '`+w2[1]+`' AND state = 'pending'`))
	require.Equal(t, 5, countRows(t, b, `SELECT count(*) FROM effects WHERE state = 'dead'`))

	page := openConsole(t, srv.URL)
	page.wait(`document.body.innerText.includes("payments")`)
	page.do(chromedp.Navigate(srv.URL + "/#failures"))
	page.wait(`document.body.dataset.ready === "1" && document.querySelectorAll("#groups tr.group").length === 7`) // the retried group holds no failures now
}
