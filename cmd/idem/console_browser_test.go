package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/pgtest"
)

// chromiumPath is Debian's chromium package.
const chromiumPath = "/usr/bin/chromium"

// screenshotDir is where the browser test saves its screenshots: $IDEM_SCREENSHOTS,
// else a directory under the system's temp dir that outlives the test.
func screenshotDir(t *testing.T) string {
	t.Helper()
	dir := os.Getenv("IDEM_SCREENSHOTS")
	if dir == "" {
		dir = filepath.Join(os.TempDir(), "idem-console-screenshots")
	}
	require.NoError(t, os.MkdirAll(dir, 0o755))
	return dir
}

// newBrowser starts headless Chromium with a fresh profile and the flags that keep
// it off the network (this machine's network is closed: without them Chromium
// waits on connections it will never get).
func newBrowser(t *testing.T) context.Context {
	t.Helper()
	if _, err := os.Stat(chromiumPath); err != nil {
		t.Fatalf("the console's browser test needs Debian's chromium at %s: install it with\n    apt-get install -y chromium\n(%v)", chromiumPath, err)
	}
	var out syncBuf
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	t.Cleanup(cancel)
	alloc, cancelAlloc := chromedp.NewExecAllocator(ctx,
		chromedp.ExecPath(chromiumPath),
		chromedp.Headless,
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.Flag("disable-quic", true),
		chromedp.NoFirstRun,
		chromedp.NoDefaultBrowserCheck,
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.Flag("disable-extensions", true),
		chromedp.Flag("hide-scrollbars", true),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1360, 1000),
		chromedp.CombinedOutput(&out),
	)
	t.Cleanup(cancelAlloc)
	browser, cancelBrowser := chromedp.NewContext(alloc, chromedp.WithErrorf(t.Logf))
	t.Cleanup(func() {
		cancelBrowser()
		if t.Failed() {
			t.Logf("chromium's output:\n%s", out.String())
		}
	})
	return browser
}

type syncBuf struct {
	mu sync.Mutex
	bytes.Buffer
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.Buffer.Write(p)
}

func (s *syncBuf) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.Buffer.String()
}

// nastyError is what the email provider answers the first time: markup that would
// run if the page ever put it in as HTML, a NUL byte (the dispatcher stores it as
// the text \x00), and a terminal escape.
const nastyError = `smtp: 550 <script>window.pwned=1</script><img src=x onerror="window.pwned=2"> mailbox unavailable` + "\x00 \x1b[31mred"

// TestConsoleInBrowser drives the console in headless Chromium: the page loads,
// shows a dead effect and its error as text, requeues it after the confirmation,
// and shows it done once a real Dispatcher has sent it.
func TestConsoleInBrowser(t *testing.T) {
	b := setup(t)
	ctx := context.Background()

	// A payment through a real consumer enqueues its receipt; the provider refuses
	// it once for good (dead), and takes it after the requeue.
	var mu sync.Mutex
	var attempts []int
	email := effects.SenderFunc(func(ctx context.Context, d effects.Delivery) error {
		mu.Lock()
		defer mu.Unlock()
		attempts = append(attempts, d.Attempt)
		if len(attempts) == 1 {
			return effects.Permanent(errors.New(nastyError))
		}
		return nil
	})
	d, err := effects.NewDispatcher(effects.Config{Pool: b.pool, Schema: b.schema,
		Senders: map[string]effects.Sender{"email": email}, PollInterval: 200 * time.Millisecond})
	require.NoError(t, err)
	dctx, stopDispatcher := context.WithCancel(ctx)
	dispatched := make(chan error, 1)
	go func() { dispatched <- d.Run(dctx) }()
	t.Cleanup(func() {
		stopDispatcher()
		require.NoError(t, <-dispatched)
	})
	b.process("acme", "pay_1", `{"amount":1200,"currency":"EUR"}`)
	pgtest.WaitFor(t, time.Minute, "the receipt to go dead", func() bool {
		return stateOfEffect(t, b, "acme", "email", "receipt:acme:pay_1") == "dead"
	})
	// More to look at: a dead SMS nobody sends, a stuck ledger write whose sender
	// died mid-send, and the HTTP request that made the payment.
	_, err = b.pool.Exec(ctx, `INSERT INTO effects (tenant, kind, key, fingerprint, state, attempts, max_attempts, in_flight, last_error, created_at, next_attempt_at) VALUES
		('acme', 'sms', 'text:pay_1', '\x00', 'dead', 5, 5, false, 'twilio: 21211 invalid To number', now() - interval '3 hours', now()),
		('globex', 'ledger', 'entry:pay_7', '\x00', 'pending', 2, 25, true, 'context deadline exceeded', now() - interval '20 minutes', now() - interval '4 minutes');
		INSERT INTO inbox (consumer, tenant, key, fingerprint, state, completed_at, expires_at, response_status, response_headers, response_body)
		VALUES ('POST /payments', 'acme', 'pay_1', '\x00', 'completed', now(), now() + interval '1 day', 201,
			convert_to(E'Content-Type: application/json\r\nLocation: /payments/pay_1\r\n', 'UTF8'), '{"id":"pay_1","email":"ann@example.com"}')`)
	require.NoError(t, err)

	srv := b.consoleServer(t, false)
	browser := newBrowser(t)
	jsErrors(t, browser)
	shots := screenshotDir(t)
	shot := func(name string) {
		t.Helper()
		png, err := chromedp.Run(browser, chromedp.FullScreenshot(100)) // quality 100 is PNG
		require.NoError(t, err)
		path := filepath.Join(shots, name)
		require.NoError(t, os.WriteFile(path, png, 0o644))
		t.Logf("screenshot: %s", path)
	}
	row := `#dead tr[data-tenant="acme"][data-kind="email"][data-key="receipt:acme:pay_1"]`
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

	require.NoError(t, chromedp.Do(browser, chromedp.Navigate(srv.URL)))
	wait(`document.body.dataset.ready === "1"`, time.Minute)
	wait(`document.querySelector('`+row+`') !== null`, 30*time.Second)

	// The error shows as text: the markup is there to read, nothing of it ran or
	// became an element, and the NUL and the escape are visible as \x00 and \x1b.
	shown := js(`document.querySelector('` + row + ` td.err').textContent`)
	require.Contains(t, shown, `<script>window.pwned=1</script><img src=x onerror="window.pwned=2">`)
	require.Contains(t, shown, `\x00 \x1b[31mred`)
	require.Equal(t, "safe", js(`(typeof window.pwned === "undefined" && document.querySelectorAll("main script, main img").length === 0) ? "safe" : "injected"`))
	require.Contains(t, js(`document.querySelector('#stuck').textContent`), "lease ran out")
	require.Equal(t, "read-write", js(`document.getElementById("mode").textContent`))
	shot("console.png")

	// Requeue, with the confirmation.
	require.NoError(t, chromedp.Do(browser, chromedp.Click(chromedp.CSS(row+` button.requeue`))))
	wait(`document.getElementById("confirm").open`, 10*time.Second)
	require.Contains(t, js(`document.getElementById("confirm-what").textContent`), "receipt:acme:pay_1")
	shot("console-confirm.png")
	require.Equal(t, "dead", stateOfEffect(t, b, "acme", "email", "receipt:acme:pay_1"), "nothing happens before the confirmation")
	require.NoError(t, chromedp.Do(browser, chromedp.Click(chromedp.ID("confirm-ok"))))

	// The dispatcher sends it, and the page shows it done.
	wait(`document.querySelector('`+row+` td.state').textContent === "done"`, 2*time.Minute)
	require.Equal(t, "done", stateOfEffect(t, b, "acme", "email", "receipt:acme:pay_1"))
	mu.Lock()
	require.Equal(t, []int{1, 1}, attempts, "sent again after the requeue, as attempt 1")
	mu.Unlock()
	// The stats follow: no dead email left, one done.
	wait(`(() => { const c = document.querySelector('#effect-stats tr[data-kind="email"]').cells; return c[5].textContent === "0" && c[6].textContent === "1"; })()`, 30*time.Second)
	shot("console-requeued.png")

	// Inspect a key across the inbox and the effects: the payment's message and
	// its HTTP request, each with what it made; the stored body is never shown.
	require.NoError(t, chromedp.Do(browser,
		chromedp.SendKeys(chromedp.ID("inspect-key"), "pay_1"),
		chromedp.Click(chromedp.CSS(`#inspect-form button[type=submit]`)),
	))
	wait(`document.querySelectorAll('#found-inbox tbody tr').length === 2`, 30*time.Second)
	require.NoError(t, chromedp.Do(browser, chromedp.Click(chromedp.CSS(`#found-inbox tbody tr:first-child button`))))
	wait(`document.getElementById('inspect-detail').textContent.includes("201, body 40 bytes (not shown), headers Content-Type, Location")`, 30*time.Second)
	require.NotContains(t, js(`document.body.textContent`), "ann@example.com")
	require.NoError(t, chromedp.Do(browser, chromedp.Click(chromedp.CSS(`#found-inbox tbody tr:nth-child(2) button`))))
	wait(`document.getElementById('inspect-detail').textContent.includes("Effects made by it: 1")`, 30*time.Second)
	require.Contains(t, js(`document.getElementById('inspect-detail').textContent`), "receipt:acme:pay_1")
	shot("console-inspect.png")
	t.Logf("screenshots are in %s (set IDEM_SCREENSHOTS to choose)", shots)
}

// A read-only console shows no requeue button.
func TestConsoleInBrowserReadOnly(t *testing.T) {
	b := setup(t)
	_, err := b.pool.Exec(context.Background(), seedDead)
	require.NoError(t, err)
	srv := b.consoleServer(t, true)
	browser := newBrowser(t)
	jsErrors(t, browser)
	require.NoError(t, chromedp.Do(browser, chromedp.Navigate(srv.URL)))
	_, err = chromedp.Run(browser, chromedp.Poll[bool](`document.body.dataset.ready === "1" && document.querySelectorAll("#dead tr.effect").length === 2`,
		chromedp.WithPollingTimeout(time.Minute)))
	require.NoError(t, err)
	n, err := chromedp.Run(browser, chromedp.Evaluate[int](`document.querySelectorAll("button.requeue").length`))
	require.NoError(t, err)
	require.Zero(t, n)
	mode, err := chromedp.Run(browser, chromedp.Evaluate[string](`document.getElementById("mode").textContent`))
	require.NoError(t, err)
	require.Equal(t, "read-only", mode)
	// One database: no shard column anywhere.
	n, err = chromedp.Run(browser, chromedp.Evaluate[int](`document.querySelectorAll(".shard").length`))
	require.NoError(t, err)
	require.Zero(t, n)
	// The Failures page shows the groups and a group's detail, with no action.
	require.NoError(t, chromedp.Do(browser, chromedp.Navigate(srv.URL+"/#failures")))
	_, err = chromedp.Run(browser, chromedp.Poll[bool](`document.body.dataset.ready === "1" && document.querySelectorAll("#groups tr.group").length === 2`,
		chromedp.WithPollingTimeout(time.Minute)))
	require.NoError(t, err)
	require.NoError(t, chromedp.Do(browser, chromedp.Click(chromedp.CSS(`#groups tr.group button.open`))))
	_, err = chromedp.Run(browser, chromedp.Poll[bool](`document.getElementById("group-facts") !== null`, chromedp.WithPollingTimeout(30*time.Second)))
	require.NoError(t, err)
	n, err = chromedp.Run(browser, chromedp.Evaluate[int](`document.querySelectorAll("#group-detail button").length + document.querySelectorAll(".shard").length`))
	require.NoError(t, err)
	require.Zero(t, n)
}

// A console run with --allow-remote, in Chromium. Without the token the page
// shows the sign-in form and nothing of the database; a wrong token is refused
// there; the right one signs the page in with a cookie its script cannot read.
// In a fresh profile, the URL that idem console prints (the token in its
// fragment, which the browser never sends) signs in at once, and the token
// leaves the address bar.
func TestConsoleInBrowserRemote(t *testing.T) {
	b := setup(t)
	_, err := b.pool.Exec(context.Background(), seedDead)
	require.NoError(t, err)
	token := "browser-" + strings.Repeat("ab12", 10)
	srv := b.consoleServerWith(t, consoleConfig{Token: token})
	browser := newBrowser(t)
	shots := screenshotDir(t)
	js := func(ctx context.Context, expr string) string {
		t.Helper()
		s, err := chromedp.Run(ctx, chromedp.Evaluate[string](expr))
		require.NoError(t, err, expr)
		return s
	}
	wait := func(ctx context.Context, expr string) {
		t.Helper()
		_, err := chromedp.Run(ctx, chromedp.Poll[bool](expr, chromedp.WithPollingTimeout(time.Minute), chromedp.WithPollingInterval(100*time.Millisecond)))
		require.NoError(t, err, "waiting for %s", expr)
	}
	const loaded = `document.body.dataset.ready === "1" && document.querySelectorAll("#dead tr.effect").length === 2`

	// No token: the sign-in form, no data.
	require.NoError(t, chromedp.Do(browser, chromedp.Navigate(srv.URL)))
	wait(browser, `document.body.dataset.login === "1" && !document.getElementById("login-section").hidden`)
	require.Equal(t, "0", js(browser, `String(document.querySelectorAll("#dead tr.effect").length)`))
	require.Equal(t, "", js(browser, `document.getElementById("schema").textContent`))
	png, err := chromedp.Run(browser, chromedp.FullScreenshot(100))
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(shots, "console-remote-login.png"), png, 0o644))

	// A wrong token is refused on the form.
	require.NoError(t, chromedp.Do(browser,
		chromedp.SendKeys(chromedp.ID("login-token"), "wrong-token"),
		chromedp.Click(chromedp.CSS(`#login-form button[type=submit]`)),
	))
	wait(browser, `!document.getElementById("error").hidden && document.getElementById("error").textContent.includes("access token")`)
	require.Equal(t, "1", js(browser, `document.body.dataset.login`))

	// The right one signs in: the data shows, and the session cookie is
	// HttpOnly (the page's script sees no cookie at all).
	js(browser, `document.getElementById("login-token").value = ""`)
	require.NoError(t, chromedp.Do(browser,
		chromedp.SendKeys(chromedp.ID("login-token"), token),
		chromedp.Click(chromedp.CSS(`#login-form button[type=submit]`)),
	))
	wait(browser, loaded)
	require.Equal(t, "", js(browser, `document.cookie`))
	require.Equal(t, "true", js(browser, `String(document.getElementById("login-section").hidden)`))
	require.Equal(t, "read-write", js(browser, `document.getElementById("mode").textContent`))
	// A reload keeps the session.
	require.NoError(t, chromedp.Do(browser, chromedp.Reload()))
	wait(browser, loaded)

	// A fresh profile, and the printed URL: signed in at once, the token gone
	// from the address bar.
	fresh, cancel := chromedp.NewContext(browser, chromedp.WithNewBrowserContext())
	defer cancel()
	require.NoError(t, chromedp.Do(fresh, chromedp.Navigate(srv.URL+"/#token="+token)))
	wait(fresh, loaded)
	require.Equal(t, srv.URL+"/", js(fresh, `location.href`))
	require.Equal(t, "", js(fresh, `document.body.dataset.login || ""`))
	require.Equal(t, "", js(fresh, `document.cookie`))
}
