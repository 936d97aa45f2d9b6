package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/chromedp/cdproto/log"
	"github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/effects"
)

// jsErrors collects what the page reports as an error: an uncaught exception, a
// console.error, and a browser log entry of level error (a blocked script, a
// resource that failed to load, a CSP violation). The test fails on any at its end.
func jsErrors(t *testing.T, browser context.Context) {
	t.Helper()
	var mu sync.Mutex
	var errs []string
	require.NoError(t, chromedp.Listen(browser, func(ev any) {
		var msg string
		switch ev := ev.(type) {
		case *runtime.EventExceptionThrown:
			msg = "exception: " + ev.ExceptionDetails.Text
			if ev.ExceptionDetails.Exception != nil {
				msg += " " + ev.ExceptionDetails.Exception.Description
			}
		case *runtime.EventConsoleAPICalled:
			if ev.Type != runtime.ConsoleAPICalledTypeError && ev.Type != runtime.ConsoleAPICalledTypeAssert {
				return
			}
			var parts []string
			for _, a := range ev.Args {
				parts = append(parts, string(a.Value)+a.Description)
			}
			msg = "console." + string(ev.Type) + ": " + strings.Join(parts, " ")
		case *log.EventEntryAdded:
			if ev.Entry.Level != log.EntryLevelError {
				return
			}
			msg = "log: " + ev.Entry.Text + " " + ev.Entry.URL
		default:
			return
		}
		mu.Lock()
		errs = append(errs, msg)
		mu.Unlock()
	}))
	t.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		if len(errs) > 0 {
			t.Errorf("the page reported %d JavaScript error(s):\n%s", len(errs), strings.Join(errs, "\n"))
		}
	})
}

// TestConsoleFailuresInBrowser drives the Failures page in headless Chromium. A
// provider rejects every receipt (one group of dead effects), the SMS provider
// every number (another), and a payment fails for good (a group of failed inbox
// keys). The provider is fixed; the operator opens the receipts' group, sees the
// dry run's count in the confirmation, gives a note, and retries it: a real
// Dispatcher sends each receipt once more, the page follows them to done, and the
// group's count falls to 0. The other groups are untouched, and the page logs no
// JavaScript error.
func TestConsoleFailuresInBrowser(t *testing.T) {
	b := setup(t)
	ctx := context.Background()

	var broken atomic.Bool
	broken.Store(true)
	var mu sync.Mutex
	sends := map[string]int{}
	count := func(d effects.Delivery) {
		mu.Lock()
		defer mu.Unlock()
		sends[d.Kind+" "+d.Key]++
	}
	email := effects.SenderFunc(func(ctx context.Context, d effects.Delivery) error {
		count(d)
		if broken.Load() {
			return effects.Permanent(fmt.Errorf(`provider: 422 payload rejected: field "amount" of %s must be an integer`, d.Key))
		}
		return nil
	})
	sms := effects.SenderFunc(func(ctx context.Context, d effects.Delivery) error {
		count(d)
		return effects.Permanent(fmt.Errorf("twilio: 21211 invalid To number %s", d.Key))
	})
	d, err := effects.NewDispatcher(effects.Config{Pool: b.pool, Schema: b.schema,
		Senders: map[string]effects.Sender{"email": email, "sms": sms}, PollInterval: 200 * time.Millisecond})
	require.NoError(t, err)
	dctx, stopDispatcher := context.WithCancel(ctx)
	dispatched := make(chan error, 1)
	go func() { dispatched <- d.Run(dctx) }()
	t.Cleanup(func() {
		stopDispatcher()
		require.NoError(t, <-dispatched)
	})

	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	scope := effects.Scope{Schema: b.schema, Tenant: "acme"}
	for i := 1; i <= 3; i++ {
		_, err := effects.Enqueue(effects.WithScope(ctx, scope), tx, effects.Effect{Kind: "email", Key: fmt.Sprintf("receipt:pay_%d", i), Payload: []byte(`{"amount":"12.00"}`)})
		require.NoError(t, err)
	}
	for i := 1; i <= 2; i++ {
		_, err := effects.Enqueue(effects.WithScope(ctx, scope), tx, effects.Effect{Kind: "sms", Key: fmt.Sprintf("text:+4470000000%d", i), Payload: []byte(`{}`)})
		require.NoError(t, err)
	}
	require.NoError(t, tx.Commit(ctx))
	b.process("acme", "pay_bad", "bad")
	deadCount := func(kind string) int {
		var n int
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM effects WHERE kind = $1 AND state = 'dead'`, kind).Scan(&n))
		return n
	}
	deadline := time.Now().Add(time.Minute)
	for deadCount("email") != 3 || deadCount("sms") != 2 {
		require.True(t, time.Now().Before(deadline), "the effects did not go dead")
		time.Sleep(50 * time.Millisecond)
	}
	broken.Store(false) // the provider is fixed

	a, err := admin.New(admin.Config{Pool: b.pool, Schema: b.schema})
	require.NoError(t, err)
	groups, err := a.ListGroups(ctx, admin.GroupFilter{}, admin.Page{})
	require.NoError(t, err)
	require.Len(t, groups.Rows, 3)
	ids := map[string]string{}
	for _, g := range groups.Rows {
		ids[g.Place()] = g.ID
	}
	emailGroup, smsGroup, inboxGroup := ids["email"], ids["sms"], ids["payments"]
	require.NotEmpty(t, emailGroup)
	require.NotEmpty(t, smsGroup)
	require.NotEmpty(t, inboxGroup)

	srv := b.consoleServer(t, false)
	browser := newBrowser(t)
	jsErrors(t, browser)
	shots := screenshotDir(t)
	shot := func(name string) {
		t.Helper()
		png, err := chromedp.Run(browser, chromedp.FullScreenshot(100))
		require.NoError(t, err)
		path := filepath.Join(shots, name)
		require.NoError(t, os.WriteFile(path, png, 0o644))
		t.Logf("screenshot: %s", path)
	}
	js := func(expr string) string {
		t.Helper()
		s, err := chromedp.Run(browser, chromedp.Evaluate[string](expr))
		require.NoError(t, err, expr)
		return s
	}
	wait := func(expr string, timeout time.Duration) {
		t.Helper()
		_, err := chromedp.Run(browser, chromedp.Poll[bool](expr, chromedp.WithPollingTimeout(timeout), chromedp.WithPollingInterval(100*time.Millisecond)))
		require.NoError(t, err, "waiting for %s", expr)
	}
	groupRow := func(id string) string { return `#groups tr[data-group="` + id + `"]` }

	require.NoError(t, chromedp.Do(browser, chromedp.Navigate(srv.URL+"/#failures")))
	wait(`document.body.dataset.ready === "1" && document.querySelectorAll("#groups tr.group").length === 3`, time.Minute)
	require.Equal(t, "failures", js(`document.body.dataset.view`))
	require.Equal(t, "none", js(`getComputedStyle(document.getElementById("dead-section")).display`), "one page at a time")
	require.Equal(t, "3", js(`document.querySelector('`+groupRow(emailGroup)+` td.count').textContent`))
	require.Equal(t, "2", js(`document.querySelector('`+groupRow(smsGroup)+` td.count').textContent`))
	require.Contains(t, js(`document.querySelector('`+groupRow(emailGroup)+` td.err').textContent`), `provider: <n> payload rejected: field "…" of receipt:pay_<n> must be an integer`)
	shot("failures.png")

	// The inbox group offers release only; the effects group retry and discard.
	require.NoError(t, chromedp.Do(browser, chromedp.Click(chromedp.CSS(groupRow(inboxGroup)+` button.open`))))
	wait(`document.querySelector("#group-detail h3") && document.querySelector("#group-detail h3").textContent === "Group `+inboxGroup+`"`, 30*time.Second)
	require.Equal(t, "1 0 0", js(`[".action-release", ".action-retry", ".action-discard"].map((s) => document.querySelectorAll("#group-detail " + s).length).join(" ")`))
	require.NoError(t, chromedp.Do(browser, chromedp.Click(chromedp.CSS(groupRow(emailGroup)+` button.open`))))
	wait(`document.querySelector("#group-detail h3").textContent === "Group `+emailGroup+`"`, 30*time.Second)
	require.Contains(t, js(`document.querySelector("#group-detail .sample-keys").textContent`), "receipt:pay_3")
	require.Equal(t, "0 1 1", js(`[".action-release", ".action-retry", ".action-discard"].map((s) => document.querySelectorAll("#group-detail " + s).length).join(" ")`))

	// Retry: the confirmation shows the dry run's count and keys, and wants a note.
	require.NoError(t, chromedp.Do(browser, chromedp.Click(chromedp.CSS(`#group-detail .action-retry`))))
	wait(`document.getElementById("failure-confirm").open`, 10*time.Second)
	require.Equal(t, "3", js(`document.getElementById("failure-confirm").dataset.rows`))
	require.Contains(t, js(`document.getElementById("failure-confirm-plan").textContent`), "requeue 3 dead effect(s)")
	require.Equal(t, "Keys: receipt:pay_1, receipt:pay_2, receipt:pay_3", js(`document.getElementById("failure-confirm-keys").textContent`))
	require.Equal(t, "Retry 3", js(`document.getElementById("failure-ok").textContent`))
	// Without a note the form does not submit: nothing changes.
	require.NoError(t, chromedp.Do(browser, chromedp.Click(chromedp.ID("failure-ok"))))
	require.Equal(t, "true", js(`String(document.getElementById("failure-confirm").open)`))
	require.Equal(t, 3, deadCount("email"), "nothing happens before the confirmation")
	require.NoError(t, chromedp.Do(browser,
		chromedp.SendKeys(chromedp.ID("failure-who"), "ann"),
		chromedp.SendKeys(chromedp.ID("failure-note"), "INC-42: the provider takes string amounts again"),
	))
	shot("failures-confirm.png")
	require.NoError(t, chromedp.Do(browser, chromedp.Click(chromedp.ID("failure-ok"))))

	// The Dispatcher sends them, the page follows them to done, and the group's
	// count falls to 0 with its action on record.
	wait(`document.querySelectorAll("#followed tbody tr").length === 3 && [...document.querySelectorAll("#followed td.state")].every((c) => c.textContent === "done")`, 2*time.Minute)
	wait(`(() => { const dt = [...document.querySelectorAll("#group-facts dt")].find((d) => d.textContent === "Count"); return dt && dt.nextElementSibling.textContent === "0"; })()`, 30*time.Second)
	require.Contains(t, js(`document.getElementById("action-result").textContent`), "Requeued 3 dead effect(s)")
	require.Contains(t, js(`document.querySelector("#group-actions tbody").textContent`), "INC-42: the provider takes string amounts again")
	require.Equal(t, "0", js(`String(document.querySelectorAll('`+groupRow(emailGroup)+`').length)`), "the emptied group leaves the list")
	require.Equal(t, "2", js(`document.querySelector('`+groupRow(smsGroup)+` td.count').textContent`))
	require.Equal(t, "1", js(`String(document.querySelectorAll('`+groupRow(inboxGroup)+`').length)`))
	shot("failures-retried.png")

	// In the tables: each receipt sent once more (one failed send, one good one),
	// the SMS and the failed payment untouched, one audited action.
	var done int
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM effects WHERE kind = 'email' AND state = 'done' AND attempts = 1`).Scan(&done))
	require.Equal(t, 3, done)
	require.Equal(t, 2, deadCount("sms"))
	var failed int
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM inbox WHERE state = 'failed'`).Scan(&failed))
	require.Equal(t, 1, failed)
	mu.Lock()
	require.Equal(t, map[string]int{"email receipt:pay_1": 2, "email receipt:pay_2": 2, "email receipt:pay_3": 2,
		"sms text:+44700000001": 1, "sms text:+44700000002": 1}, sends)
	mu.Unlock()
	var who, why string
	var rows int64
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT who, why, affected FROM failure_actions WHERE action = 'retry'`).Scan(&who, &why, &rows))
	require.Equal(t, int64(3), rows)
	require.True(t, strings.HasPrefix(who, "ann (console, 127.0.0.1)"), who)
	require.Equal(t, "INC-42: the provider takes string amounts again", why)
	t.Logf("screenshots are in %s", shots)
}

// The failures API of the console: the list and one group read; an action needs
// the page's token, a writable console, the right source and a note, and its dry
// run changes nothing.
func TestConsoleFailuresAPI(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	b.process("acme", "pay_bad", "bad")
	srv := b.consoleServer(t, false)
	var session sessionJSON
	require.NoError(t, json.Unmarshal(call(t, srv, "GET", "/api/session", "", nil).body, &session))

	r := call(t, srv, "GET", "/api/failures", "", nil)
	require.Equal(t, http.StatusOK, r.status, "%s", r.body)
	var groups groupPageJSON
	require.NoError(t, json.Unmarshal(r.body, &groups))
	require.Len(t, groups.Groups, 1)
	g := groups.Groups[0]
	require.Equal(t, int64(1), g.Count)
	r = call(t, srv, "GET", "/api/failures/group?id="+g.ID, "", nil)
	require.Equal(t, http.StatusOK, r.status, "%s", r.body)
	require.Equal(t, "bad_filter", call(t, srv, "GET", "/api/failures/group?id=nope", "", nil).code(t))

	through := g.LastSeen.Format(time.RFC3339Nano)
	body := func(action string, dry bool, why string) string {
		return fmt.Sprintf(`{"id":%q,"action":%q,"through":%q,"dry_run":%t,"at_most":1,"who":"ann","why":%q}`, g.ID, action, through, dry, why)
	}
	token := map[string]string{"X-Idem-Token": session.Token, "Content-Type": "application/json"}
	require.Equal(t, "bad_token", call(t, srv, "POST", "/api/failures/action", body("release", false, "fixed"), nil).code(t))
	require.Equal(t, "wrong_source", call(t, srv, "POST", "/api/failures/action", body("retry", false, "fixed"), token).code(t))
	require.Equal(t, "note_required", call(t, srv, "POST", "/api/failures/action", body("release", false, ""), token).code(t))
	require.Equal(t, "bad_request", call(t, srv, "POST", "/api/failures/action", body("explode", false, "x"), token).code(t))
	r = call(t, srv, "POST", "/api/failures/action", body("release", true, ""), token)
	require.Equal(t, http.StatusOK, r.status, "%s", r.body)
	var plan admin.ActionResult
	require.NoError(t, json.Unmarshal(r.body, &plan))
	require.Equal(t, int64(1), plan.Rows)
	require.Equal(t, []string{"pay_bad"}, plan.Keys)
	var n int
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM inbox WHERE state = 'failed'`).Scan(&n))
	require.Equal(t, 1, n, "a dry run changes nothing")

	ro := b.consoleServer(t, true)
	require.Equal(t, "read_only", call(t, ro, "POST", "/api/failures/action", body("release", false, "fixed"), token).code(t))

	r = call(t, srv, "POST", "/api/failures/action", body("release", false, "fixed"), token)
	require.Equal(t, http.StatusOK, r.status, "%s", r.body)
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM inbox WHERE state = 'failed'`).Scan(&n))
	require.Zero(t, n)
	// The emptied group still answers, with its count at 0 and its action.
	r = call(t, srv, "GET", "/api/failures/group?id="+g.ID, "", nil)
	require.Equal(t, http.StatusOK, r.status, "%s", r.body)
	var empty admin.FailureGroup
	require.NoError(t, json.Unmarshal(r.body, &empty))
	require.Zero(t, empty.Count)
	require.Equal(t, "payments", empty.Consumer)
	require.Len(t, empty.Actions, 1)
	require.Equal(t, "fixed", empty.Actions[0].Why)
}

// TestConsoleChartsInBrowser: the overview's charts, drawn as plain SVG from the
// activity API, show a seeded minute: the keys completed and failed ten minutes
// ago, the effects sent five minutes ago, the backlog and the age of its oldest
// effect; over the last hour and over the last day, with no JavaScript error.
func TestConsoleChartsInBrowser(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	_, err := b.pool.Exec(ctx, `INSERT INTO inbox (consumer, key, fingerprint, state, completed_at, expires_at)
		SELECT 'payments', 'k' || g, '\x00', CASE WHEN g <= 3 THEN 'completed' ELSE 'failed' END,
			date_trunc('minute', now()) - interval '10 minutes' + g * interval '5 seconds', now() + interval '1 day'
		FROM generate_series(1, 4) g;
		INSERT INTO effects (kind, key, fingerprint, state, created_at, done_at) VALUES
		('email', 'sent1', '\x00', 'done', date_trunc('minute', now()) - interval '7 minutes', date_trunc('minute', now()) - interval '5 minutes' + interval '10 seconds'),
		('email', 'sent2', '\x00', 'done', date_trunc('minute', now()) - interval '7 minutes', date_trunc('minute', now()) - interval '5 minutes' + interval '20 seconds'),
		('email', 'waiting', '\x00', 'pending', date_trunc('minute', now()) - interval '30 minutes', NULL)`)
	require.NoError(t, err)
	var m10, m5 time.Time
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT date_trunc('minute', now()) - interval '10 minutes', date_trunc('minute', now()) - interval '5 minutes'`).Scan(&m10, &m5))

	srv := b.consoleServer(t, false)
	browser := newBrowser(t)
	jsErrors(t, browser)
	js := func(expr string) string {
		t.Helper()
		s, err := chromedp.Run(browser, chromedp.Evaluate[string](expr))
		require.NoError(t, err, expr)
		return s
	}
	wait := func(expr string) {
		t.Helper()
		_, err := chromedp.Run(browser, chromedp.Poll[bool](expr, chromedp.WithPollingTimeout(time.Minute), chromedp.WithPollingInterval(100*time.Millisecond)))
		require.NoError(t, err, "waiting for %s", expr)
	}
	// point is the value of series' dot at minute, "" when there is none.
	point := func(chart, series string, minute time.Time) string {
		return js(fmt.Sprintf(`(() => { const c = [...document.querySelectorAll('#chart-%s g[data-series="%s"] circle')].find((c) => new Date(c.dataset.at).getTime() === %d); return c ? c.dataset.value : ""; })()`,
			chart, series, minute.UnixMilli()))
	}
	check := func(window string, minutes int) {
		t.Helper()
		wait(`document.getElementById("charts").dataset.window === "` + window + `" && document.querySelectorAll("#charts svg").length === 4`)
		require.Equal(t, fmt.Sprint(minutes), js(`String(document.querySelector('#chart-inbox g[data-series="completed"] polyline').getAttribute("points").split(" ").length)`))
		require.Equal(t, "3", point("inbox", "completed", m10))
		require.Equal(t, "1", point("inbox", "failed", m10))
		require.Equal(t, "", point("inbox", "completed", m5))
		require.Equal(t, "2", point("effects", "sent", m5))
		require.Equal(t, "", point("effects", "dead", m5))
		// At the end of minute M-10 the two sent (enqueued at M-7) had not come
		// yet: the one waiting since M-30 is the backlog, 21 minutes old.
		require.Equal(t, "1", point("backlog", "pending", m10))
		require.Equal(t, "3", point("backlog", "pending", m5.Add(-time.Minute)))
		require.Equal(t, "1260", point("oldest", "oldest", m10))
		require.Contains(t, js(`document.querySelector('#chart-inbox circle[data-value="3"] title').textContent`), "completed: 3")
		require.Contains(t, js(`document.querySelector('#chart-oldest title').textContent`), "Oldest pending effect")
	}
	require.NoError(t, chromedp.Do(browser, chromedp.Navigate(srv.URL)))
	wait(`document.body.dataset.ready === "1"`)
	check("hour", 60)
	shots := screenshotDir(t)
	png, err := chromedp.Run(browser, chromedp.FullScreenshot(100))
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(shots, "console-charts.png"), png, 0o644))

	require.NoError(t, chromedp.Do(browser, chromedp.Click(chromedp.ID("window-day"))))
	check("day", 1440)
	require.Equal(t, "true", js(`document.getElementById("window-day").getAttribute("aria-pressed")`))
	png, err = chromedp.Run(browser, chromedp.FullScreenshot(100))
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(shots, "console-charts-day.png"), png, 0o644))

	r := call(t, srv, "GET", "/api/activity?window=week", "", nil)
	require.Equal(t, http.StatusBadRequest, r.status)
	require.Equal(t, "bad_filter", r.code(t))
}

// seedGroups makes four failure groups: failed payments of acme (2 keys, minutes
// ago), a failed order of globex (3 days ago), dead receipts of acme (2 effects)
// and a dead SMS of globex (a minute ago). The inbox groups have the code handler,
// the effects groups provider_rejected.
const seedGroups = `INSERT INTO inbox (consumer, tenant, key, fingerprint, state, expires_at, completed_at, error_code, error) VALUES
	('payments', 'acme', 'pay_1', '\x00', 'failed', now() + interval '7 days', now() - interval '5 minutes', 'handler', 'card 4242 declined'),
	('payments', 'acme', 'pay_2', '\x00', 'failed', now() + interval '7 days', now() - interval '4 minutes', 'handler', 'card 4343 declined'),
	('orders', 'globex', 'ord_1', '\x00', 'failed', now() + interval '7 days', now() - interval '3 days', 'handler', 'order 17 refused');
	INSERT INTO effects (tenant, kind, key, fingerprint, state, attempts, error_code, last_error, dead_at) VALUES
	('acme', 'email', 'receipt:pay_1', '\x00', 'dead', 25, 'provider_rejected', 'smtp: 550 mailbox 1 unavailable', now() - interval '3 minutes'),
	('acme', 'email', 'receipt:pay_2', '\x00', 'dead', 25, 'provider_rejected', 'smtp: 550 mailbox 2 unavailable', now() - interval '2 minutes'),
	('globex', 'sms', 'text:ord_1', '\x00', 'dead', 5, 'provider_rejected', 'twilio: 21211 invalid To number 17', now() - interval '1 minute')`

// seedGroupIDs seeds seedGroups and returns the groups' IDs by consumer or kind.
func seedGroupIDs(t *testing.T, b *bundle) map[string]string {
	t.Helper()
	ctx := context.Background()
	_, err := b.pool.Exec(ctx, seedGroups)
	require.NoError(t, err)
	a, err := admin.New(admin.Config{Pool: b.pool, Schema: b.schema})
	require.NoError(t, err)
	groups, err := a.ListGroups(ctx, admin.GroupFilter{}, admin.Page{})
	require.NoError(t, err)
	require.Len(t, groups.Rows, 4)
	ids := map[string]string{}
	for _, g := range groups.Rows {
		ids[g.Place()] = g.ID
	}
	require.Len(t, ids, 4)
	return ids
}

// TestConsoleFailuresAPIFilters: /api/failures passes its filters to the group
// list: consumer, kind, tenant, error code, and a time window as a time or an
// age; a bad time or code is a 400 with code bad_filter.
func TestConsoleFailuresAPIFilters(t *testing.T) {
	b := setup(t)
	ids := seedGroupIDs(t, b)
	srv := b.consoleServer(t, true)
	list := func(query string) []string {
		t.Helper()
		r := call(t, srv, "GET", "/api/failures?"+query, "", nil)
		require.Equal(t, http.StatusOK, r.status, "%s: %s", query, r.body)
		var page groupPageJSON
		require.NoError(t, json.Unmarshal(r.body, &page))
		var places []string
		for _, g := range page.Groups {
			require.Equal(t, ids[g.Place()], g.ID)
			places = append(places, g.Place())
		}
		slices.Sort(places)
		return places
	}
	require.Equal(t, []string{"email", "orders", "payments", "sms"}, list(""))
	require.Equal(t, []string{"orders", "sms"}, list("tenant=globex"))
	require.Equal(t, []string{"payments"}, list("consumer=payments"))
	require.Equal(t, []string{"email"}, list("kind=email"))
	require.Equal(t, []string{"email", "payments", "sms"}, list("since=1d"))
	require.Equal(t, []string{"sms"}, list("since=1d&tenant=globex"))
	require.Equal(t, []string{"orders"}, list("until=2h"))
	since := time.Now().Add(-150 * time.Second).UTC().Format(time.RFC3339Nano)
	require.Equal(t, []string{"email", "sms"}, list("since="+url.QueryEscape(since)))
	require.Empty(t, list("tenant=nobody"))
	require.Equal(t, []string{"orders", "payments"}, list("code=handler"))
	require.Equal(t, []string{"email", "sms"}, list("code=provider_rejected"))
	require.Equal(t, []string{"sms"}, list("code=provider_rejected&tenant=globex"))
	require.Equal(t, []string{"payments"}, list("code=handler&since=1d"))
	require.Empty(t, list("code=payment_declined"))
	r := call(t, srv, "GET", "/api/failures?code=bad%00code", "", nil)
	require.Equal(t, http.StatusBadRequest, r.status, "%s", r.body)
	require.Equal(t, "bad_filter", r.code(t))
	require.Contains(t, string(r.body), "error code")
	r = call(t, srv, "GET", "/api/failures?since=yesterday", "", nil)
	require.Equal(t, http.StatusBadRequest, r.status, "%s", r.body)
	require.Equal(t, "bad_filter", r.code(t))
	require.Contains(t, string(r.body), "since")
}

// browserPage drives one console page in headless Chromium, failing the test on
// any JavaScript error of the page.
type browserPage struct {
	t   *testing.T
	ctx context.Context
}

func openConsole(t *testing.T, url string) browserPage {
	t.Helper()
	browser := newBrowser(t)
	jsErrors(t, browser)
	require.NoError(t, chromedp.Do(browser, chromedp.Navigate(url)))
	p := browserPage{t, browser}
	p.wait(`document.body.dataset.ready === "1"`)
	return p
}

func (p browserPage) js(expr string) string {
	p.t.Helper()
	s, err := chromedp.Run(p.ctx, chromedp.Evaluate[string](expr))
	require.NoError(p.t, err, expr)
	return s
}

func (p browserPage) wait(expr string) {
	p.t.Helper()
	_, err := chromedp.Run(p.ctx, chromedp.Poll[bool](expr, chromedp.WithPollingTimeout(time.Minute), chromedp.WithPollingInterval(100*time.Millisecond)))
	require.NoError(p.t, err, "waiting for %s", expr)
}

func (p browserPage) do(actions ...chromedp.Action[chromedp.Void]) {
	p.t.Helper()
	require.NoError(p.t, chromedp.Do(p.ctx, actions...))
}

// click waits for the element that selector names and clicks it.
func (p browserPage) click(selector string) {
	p.t.Helper()
	p.wait(`!!document.querySelector('` + selector + `')`)
	p.js(`(() => { document.querySelector('` + selector + `').click(); return ""; })()`)
}

// shownGroups is, sorted and space-separated, the groups the Failures page lists.
const shownGroups = `[...document.querySelectorAll("#groups tr.group")].map((r) => r.dataset.group).sort().join(" ")`

// TestConsoleFailureFiltersInBrowser: the Failures page's filters (consumer, kind,
// tenant, error code, the time window) narrow the list to the expected groups, together and
// apart, and a filter that matches nothing says so; no JavaScript error.
func TestConsoleFailureFiltersInBrowser(t *testing.T) {
	b := setup(t)
	ids := seedGroupIDs(t, b)
	srv := b.consoleServer(t, true)
	p := openConsole(t, srv.URL+"/#failures")
	expect := func(places ...string) string {
		var want []string
		for _, pl := range places {
			want = append(want, ids[pl])
		}
		slices.Sort(want)
		return strings.Join(want, " ")
	}
	p.wait(shownGroups + ` === "` + expect("email", "orders", "payments", "sms") + `"`)
	// The consumers and kinds are suggested.
	p.wait(`[...document.querySelectorAll("#known-kinds option")].map((o) => o.value).sort().join(" ") === "email sms"`)
	filter := func(consumer, kind, tenant, code, since string, places ...string) {
		t.Helper()
		p.js(fmt.Sprintf(`(() => { const set = (n, v) => { document.getElementById("groups-" + n).value = v; };
			set("consumer", %q); set("kind", %q); set("tenant", %q); set("code", %q); set("since", %q); return ""; })()`, consumer, kind, tenant, code, since))
		p.do(chromedp.Click(chromedp.CSS(`#groups-filter button[type=submit]`)))
		want := expect(places...)
		p.wait(shownGroups + ` === "` + want + `"`)
		if len(places) == 0 {
			p.wait(`document.querySelector("#groups td.empty").textContent === "no failure group matches these filters"`)
		}
	}
	filter("", "", "globex", "", "", "orders", "sms")
	filter("payments", "", "", "", "", "payments")
	filter("", "email", "", "", "", "email")
	filter("", "", "", "", "1d", "email", "payments", "sms")
	filter("", "", "globex", "", "1d", "sms")
	filter("", "", "", "handler", "", "orders", "payments")
	filter("", "", "", " provider_rejected ", "", "email", "sms")
	filter("", "", "globex", "handler", "", "orders")
	filter("", "", "", "payment_declined", "")
	filter("", "", "nobody", "", "")
	filter("", "", "", "", "", "email", "orders", "payments", "sms")
	png, err := chromedp.Run(p.ctx, chromedp.FullScreenshot(100))
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(screenshotDir(t), "console-failure-filters.png"), png, 0o644))
}

// TestConsoleDiscardReleaseInBrowser: on the Failures page the operator discards
// the dead receipts' group and releases the failed payments' group, each through
// its confirmation (its dry run's count, a note); a cancelled confirmation changes
// nothing. In Postgres afterwards: the receipts are discarded and the payments'
// keys gone (released), the other groups untouched, each action audited.
func TestConsoleDiscardReleaseInBrowser(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	ids := seedGroupIDs(t, b)
	srv := b.consoleServer(t, false)
	p := openConsole(t, srv.URL+"/#failures")
	p.wait(`document.querySelectorAll("#groups tr.group").length === 4`)
	count := func(query string) int {
		t.Helper()
		var n int
		require.NoError(t, b.pool.QueryRow(ctx, query).Scan(&n))
		return n
	}
	confirm := func(place, action, rows, note string) {
		t.Helper()
		// The list and the detail are drawn again after each action: click in the
		// page, on the node there now.
		p.click(`#groups tr[data-group="` + ids[place] + `"] button.open`)
		p.wait(`!!document.querySelector("#group-detail h3") && document.querySelector("#group-detail h3").textContent === "Group ` + ids[place] + `"`)
		p.click(`#group-detail .action-` + action)
		p.wait(`document.getElementById("failure-confirm").open`)
		require.Equal(t, rows, p.js(`document.getElementById("failure-confirm").dataset.rows`))
		if note == "" {
			p.do(chromedp.Click(chromedp.ID("failure-cancel")))
			p.wait(`!document.getElementById("failure-confirm").open`)
			return
		}
		// The page keeps the name typed last; the note is asked each time.
		p.js(`document.getElementById("failure-who").value = ""`)
		require.Equal(t, "", p.js(`document.getElementById("failure-note").value`))
		p.do(chromedp.SendKeys(chromedp.ID("failure-who"), "ann"), chromedp.SendKeys(chromedp.ID("failure-note"), note))
		p.do(chromedp.Click(chromedp.ID("failure-ok")))
	}

	// Discard, cancelled first: nothing changes.
	confirm("email", "discard", "2", "")
	require.Equal(t, 2, count(`SELECT count(*) FROM effects WHERE kind = 'email' AND state = 'dead'`))
	confirm("email", "discard", "2", "INC-7: the customers left")
	p.wait(`!!document.getElementById("action-result") && document.getElementById("action-result").textContent.startsWith("Discarded 2 dead effect(s)")`)
	p.wait(`document.querySelectorAll('#groups tr[data-group="` + ids["email"] + `"]').length === 0`)
	require.Equal(t, 2, count(`SELECT count(*) FROM effects WHERE kind = 'email' AND state = 'discarded' AND done_at IS NOT NULL`))
	require.Equal(t, 1, count(`SELECT count(*) FROM effects WHERE kind = 'sms' AND state = 'dead'`))

	// Release, cancelled first: nothing changes.
	confirm("payments", "release", "2", "")
	require.Equal(t, 2, count(`SELECT count(*) FROM inbox WHERE consumer = 'payments' AND state = 'failed'`))
	confirm("payments", "release", "2", "INC-8: the card check is fixed")
	p.wait(`!!document.getElementById("action-result") && document.getElementById("action-result").textContent.startsWith("Released 2 failed inbox key(s)")`)
	p.wait(`document.querySelectorAll('#groups tr[data-group="` + ids["payments"] + `"]').length === 0`)
	require.Equal(t, 0, count(`SELECT count(*) FROM inbox WHERE consumer = 'payments'`), "released keys are deleted: the next delivery runs the handler again")
	require.Equal(t, 1, count(`SELECT count(*) FROM inbox WHERE consumer = 'orders' AND state = 'failed'`))
	p.wait(shownGroups + ` === "` + strings.Join(slices.Sorted(slices.Values([]string{ids["orders"], ids["sms"]})), " ") + `"`)

	// Each action is audited once, with its note and the console's mark.
	rows, err := b.pool.Query(ctx, `SELECT action, affected, who, why FROM failure_actions ORDER BY action`)
	require.NoError(t, err)
	defer rows.Close()
	type audit struct {
		action string
		rows   int64
		who    string
		why    string
	}
	var got []audit
	for rows.Next() {
		var a audit
		require.NoError(t, rows.Scan(&a.action, &a.rows, &a.who, &a.why))
		require.True(t, strings.HasPrefix(a.who, "ann (console, 127.0.0.1)"), a.who)
		a.who = ""
		got = append(got, a)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []audit{{"discard", 2, "", "INC-7: the customers left"}, {"release", 2, "", "INC-8: the card check is fixed"}}, got)
}
