package main

import (
	"context"
	"fmt"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/shard"
)

// TestConsoleInBrowserShards: the console over a shard map of the 3 shard
// clusters and a fourth shard nobody listens on shows, in headless Chromium, each
// shard's figures and the fourth as down, with the sums of the three that answer;
// over the three, a failure group on two shards is one row of the Failures page,
// and its detail shows each shard's part. Every list shows each row's shard: the
// dead effects, the keys found by Inspect, the failure groups (a merged group,
// its shards).
func TestConsoleInBrowserShards(t *testing.T) {
	t.Parallel()
	m := pgtest.Shards(t)
	ctx := context.Background()
	for i, s := range m.Shards {
		_, err := s.Pool.Exec(ctx, `INSERT INTO inbox (consumer, tenant, key, fingerprint, state, expires_at)
			SELECT 'orders', 't', 'k' || g, '\x00', 'completed', now() + interval '1 day' FROM generate_series(1, $1) g`, i+1)
		require.NoError(t, err)
		_, err = s.Pool.Exec(ctx, `INSERT INTO effects (tenant, kind, key, fingerprint) VALUES ('t', 'email', 'e', '\x00')`)
		require.NoError(t, err)
	}
	// A dead SMS on s1 and another on s2: one row each in the dead effects, each
	// with its shard, and one failure group over the two shards.
	for i := range 2 {
		_, err := m.Shards[i].Pool.Exec(ctx, `INSERT INTO effects (tenant, kind, key, fingerprint, state, attempts, last_error)
			VALUES ('t', 'sms', $1, '\x00', 'dead', 5, 'twilio: 21211 invalid To number')`, fmt.Sprintf("text:on-s%d", i+1))
		require.NoError(t, err)
	}
	down, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=2")
	require.NoError(t, err)
	t.Cleanup(down.Close)
	withDown := &shard.Map{Shards: append(append([]shard.Shard{}, m.Shards...), shard.Shard{Name: "s4", Pool: down, Schema: m.Shards[0].Schema})}
	a, err := admin.New(admin.Config{Shards: withDown})
	require.NoError(t, err)
	srv := httptest.NewUnstartedServer(nil)
	h, err := newConsole(a, consoleConfig{ReadOnly: true, Hosts: consoleHosts(srv.Listener.Addr(), "127.0.0.1")})
	require.NoError(t, err)
	srv.Config.Handler = h
	srv.Start()
	t.Cleanup(srv.Close)

	// The page over s4 logs the failed reads of s4 (its lists answer 500); the
	// page over the three that answer must log no error.
	browser := newBrowser(t)
	wait := func(expr string) {
		t.Helper()
		_, err := chromedp.Run(browser, chromedp.Poll[bool](expr, chromedp.WithPollingTimeout(time.Minute), chromedp.WithPollingInterval(100*time.Millisecond)))
		require.NoError(t, err, "waiting for %s", expr)
	}
	js := func(expr string) string {
		t.Helper()
		s, err := chromedp.Run(browser, chromedp.Evaluate[string](expr))
		require.NoError(t, err, expr)
		return s
	}
	require.NoError(t, chromedp.Do(browser, chromedp.Navigate(srv.URL)))
	wait(`document.querySelectorAll('#shard-stats tbody tr').length === 4`)
	require.False(t, js(`String(document.getElementById("shards-part").hidden)`) == "true")
	for i, name := range []string{"s1", "s2", "s3"} {
		cells := `document.querySelector('#shard-stats tr[data-shard="` + name + `"]').cells`
		require.Equal(t, "up", js(cells+`[2].textContent`))
		require.Equal(t, "1", js(cells+`[5].textContent`), name)
		require.Equal(t, string(rune('1'+i)), js(cells+`[3].textContent`), name)
	}
	require.Equal(t, "shards s1, s2, s3, s4", js(`document.getElementById("schema").textContent`))
	require.Contains(t, js(`document.querySelector('#shard-stats tr[data-shard="s4"]').cells[2].textContent`), "down: ")
	require.Contains(t, js(`document.querySelector('#shard-stats tr[data-shard="s4"]').cells[2].textContent`), "connection refused")
	// The sums are those of the shards that answered.
	wait(`document.querySelector('#consumer-stats tbody tr').cells[1].textContent === "6"`)
	png, err := chromedp.Run(browser, chromedp.FullScreenshot(100))
	require.NoError(t, err)
	path := filepath.Join(screenshotDir(t), "console-shards.png")
	require.NoError(t, os.WriteFile(path, png, 0o644))
	t.Logf("screenshot: %s", path)

	// The Failures page over the three shards that answer: a group with failures on
	// s1 and s3 is one row, its counts summed; its detail shows each shard's part.
	for i, n := range map[int]int{0: 2, 2: 3} {
		_, err := m.Shards[i].Pool.Exec(ctx, `INSERT INTO inbox (consumer, tenant, key, fingerprint, state, expires_at, completed_at, error_code, error)
			SELECT 'orders', 't', 'f' || g, '\x00', 'failed', now() + interval '1 day', now(), 'handler', 'order ' || g || ' refused'
			FROM generate_series(1, $1) g`, n)
		require.NoError(t, err)
	}
	up, err := admin.New(admin.Config{Shards: m})
	require.NoError(t, err)
	srv2 := httptest.NewUnstartedServer(nil)
	h2, err := newConsole(up, consoleConfig{ReadOnly: true, Hosts: consoleHosts(srv2.Listener.Addr(), "127.0.0.1")})
	require.NoError(t, err)
	srv2.Config.Handler = h2
	srv2.Start()
	t.Cleanup(srv2.Close)
	tab, cancelTab := chromedp.NewContext(browser)
	t.Cleanup(cancelTab)
	jsErrors(t, tab)
	browser = tab
	require.NoError(t, chromedp.Do(browser, chromedp.Navigate(srv2.URL)))
	// Each dead effect shows its shard, under a Shard heading.
	wait(`document.querySelectorAll('#dead tr.effect').length === 2`)
	require.Equal(t, "Shard", js(`document.querySelector('#dead thead th').textContent`))
	for _, name := range []string{"s1", "s2"} {
		require.Equal(t, name, js(`document.querySelector('#dead tr[data-key="text:on-`+name+`"] td.shard').textContent`))
	}
	// Inspect finds key k2 on s2 and s3 (s1 has k1 only), each row with its shard.
	require.NoError(t, chromedp.Do(browser,
		chromedp.SendKeys(chromedp.ID("inspect-key"), "k2"),
		chromedp.Click(chromedp.CSS(`#inspect-form button[type=submit]`)),
	))
	wait(`document.querySelectorAll('#found-inbox tbody tr').length === 2`)
	require.Equal(t, "s2 s3", js(`[...document.querySelectorAll('#found-inbox tbody td.shard')].map((c) => c.textContent).sort().join(" ")`))
	require.Equal(t, "Shard", js(`document.querySelector('#found-inbox thead th').textContent`))
	png, err = chromedp.Run(browser, chromedp.FullScreenshot(100))
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(screenshotDir(t), "console-shards-lists.png"), png, 0o644))
	require.NoError(t, chromedp.Do(browser, chromedp.Navigate(srv2.URL+"/#failures")))
	wait(`document.querySelectorAll('#groups tbody tr.group').length === 2`)
	inboxGroup := `#groups tbody tr.group[data-source="inbox"]`
	require.Equal(t, "5", js(`document.querySelector('`+inboxGroup+` td.count').textContent`))
	require.Equal(t, "s1, s3", js(`document.querySelector('`+inboxGroup+` td.shard').textContent`))
	require.Equal(t, "s1, s2", js(`document.querySelector('#groups tbody tr.group[data-source="effects"] td.shard').textContent`))
	require.Equal(t, "Shard", js(`document.querySelector('#groups thead th').textContent`))
	require.NoError(t, chromedp.Do(browser, chromedp.Click(chromedp.CSS(inboxGroup+` button.open`))))
	wait(`!!document.getElementById("group-facts")`)
	require.Contains(t, js(`document.getElementById("group-facts").textContent`), "Shardss1: 2, s3: 3")
}
