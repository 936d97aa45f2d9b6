package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/internal/pgtest"
)

// idemAt runs the CLI as b.idem does, with its clock (what an age such as
// --since 1h is read against) at now.
func (b *bundle) idemAt(now time.Time, args ...string) result {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(context.WithValue(context.Background(), clockKey{}, func() time.Time { return now }), 30*time.Second)
	defer cancel()
	var out, errOut bytes.Buffer
	code := run(ctx, append(args, "--database-url", pgtest.URL(), "--schema", b.schema), &out, &errOut)
	return result{code: code, stdout: out.String(), stderr: errOut.String()}
}

var nextPageHint = regexp.MustCompile(`\(first 1 shown; next page: ([^)]*)\)\n`)

// TestPagingPinsAges: a paged list given --since 1h --until 10m prints, for its
// next page, the cursor and the absolute times the ages were read as (to the
// second), in its text hint and in the --json object on stderr; run again an
// hour later with those arguments added, it lists the rest of the same window,
// not a window an hour later. The rows sit on the window's edges (one at its
// start, one a millisecond before it, one at its end), so each page shows the
// window it read. So for inbox list, effects list and failures.
func TestPagingPinsAges(t *testing.T) {
	b := setup(t)
	now := time.Now() // not a whole second: the window is read to the second
	since := now.Add(-time.Hour).UTC().Truncate(time.Second)
	until := now.Add(-10 * time.Minute).UTC().Truncate(time.Second)
	// a: at since (in); b: a millisecond before (out); c: inside; d: at until (out).
	at := map[string]time.Time{"a": since, "b": since.Add(-time.Millisecond), "c": now.Add(-20 * time.Minute), "d": until}
	ctx := context.Background()
	for _, x := range []string{"a", "b", "c", "d"} {
		_, err := b.pool.Exec(ctx, `INSERT INTO inbox (consumer, key, fingerprint, state, received_at, expires_at)
			VALUES ('pager', 'pager-'||$1, '\x00', 'completed', $2, now() + interval '1 day')`, x, at[x])
		require.NoError(t, err)
		_, err = b.pool.Exec(ctx, `INSERT INTO effects (kind, key, fingerprint, state, attempts, last_error, created_at, dead_at)
			VALUES ('pager', 'pager-'||$1, '\x00', 'dead', 25, 'boom', $2, $2)`, x, at[x])
		require.NoError(t, err)
	}
	// Failure groups in count order: failing-a (3), failing-b and failing-d (2
	// each, outside the window), failing-c (1).
	for x, n := range map[string]int{"a": 3, "b": 2, "c": 1, "d": 2} {
		_, err := b.pool.Exec(ctx, `INSERT INTO inbox (consumer, key, fingerprint, state, expires_at, completed_at, error_code, error)
			SELECT 'failing-'||$1, 'k'||i, '\x00', 'failed', now() + interval '1 day', $2, 'handler', 'declined'
			FROM generate_series(1, $3::int) i`, x, at[x], n)
		require.NoError(t, err)
	}

	for _, c := range []struct {
		args  []string
		field string // the JSON field that names a row
		name  string // how the rows are named: name + a, b, c or d
	}{
		{[]string{"inbox", "list", "--consumer", "pager"}, "key", "pager-"},
		{[]string{"effects", "list", "--kind", "pager"}, "key", "pager-"},
		{[]string{"failures", "--source", "inbox"}, "consumer", "failing-"},
	} {
		args := slices.Concat(c.args, []string{"--since", "1h", "--until", "10m", "--limit", "1"})
		pinned := []string{"--since", since.Format(time.RFC3339), "--until", until.Format(time.RFC3339)}
		// The text hint.
		r := b.idemAt(now, args...).ok(t)
		require.Contains(t, r.stdout, c.name+"a", "%q", args)
		hint := nextPageHint.FindStringSubmatch(r.stdout)
		require.NotNil(t, hint, "%q: %s", args, r.stdout)
		next := strings.Fields(hint[1])
		require.Len(t, next, 6, hint[1])
		require.Equal(t, "--after", next[0])
		require.Equal(t, pinned, next[2:], "%q: the ages as the times the page read", args)
		// An hour later, "--since 1h --until 10m" is another window; with the
		// hint's arguments added, the next page is the rest of this one.
		r = b.idemAt(now.Add(time.Hour), slices.Concat(args, next)...).ok(t)
		require.Contains(t, r.stdout, c.name+"c", "%q", args)
		for _, out := range []string{"a", "b", "d"} {
			require.NotContains(t, r.stdout, c.name+out, "%q", args)
		}
		require.NotContains(t, r.stdout, "next page", "%q", args)

		// --json: the object on stderr.
		var rows []map[string]any
		r = b.idemAt(now, slices.Concat(args, []string{"--json"})...).ok(t)
		r.decode(t, &rows)
		require.Len(t, rows, 1)
		require.Equal(t, c.name+"a", rows[0][c.field])
		var obj struct {
			NextAfter string   `json:"next_after"`
			NextArgs  []string `json:"next_args"`
			Message   string   `json:"message"`
		}
		require.NoError(t, json.Unmarshal([]byte(r.stderr), &obj), r.stderr)
		require.Equal(t, next[1], obj.NextAfter)
		require.Equal(t, next, obj.NextArgs)
		require.True(t, strings.HasSuffix(obj.Message, "; next page: "+hint[1]), obj.Message)
		r = b.idemAt(now.Add(time.Hour), slices.Concat(args, obj.NextArgs, []string{"--json"})...).ok(t)
		r.decode(t, &rows)
		require.Len(t, rows, 1, "%q: %s", args, r.stdout)
		require.Equal(t, c.name+"c", rows[0][c.field])
		require.Empty(t, r.stderr)

		// Times given as times are the command line's own: the hint adds none.
		abs := slices.Concat(c.args, []string{"--since", since.Format(time.RFC3339), "--until", until.Format(time.RFC3339), "--limit", "1"})
		r = b.idemAt(now, abs...).ok(t)
		require.Equal(t, []string{"--after", next[1]}, strings.Fields(nextPageHint.FindStringSubmatch(r.stdout)[1]))
	}
}

// clock is a test's clock that it moves on.
type clock struct{ at atomic.Pointer[time.Time] }

func (c *clock) set(t time.Time) { c.at.Store(&t) }
func (c *clock) now() time.Time  { return *c.at.Load() }

// pinnedConsole serves the console with its clock at c, and records the query of
// every /api/failures request that asks for a next page.
func (b *bundle) pinnedConsole(t *testing.T, c *clock) (*httptest.Server, func() []url.Values) {
	t.Helper()
	a, err := admin.New(admin.Config{Pool: b.pool, Schema: b.schema})
	require.NoError(t, err)
	srv := httptest.NewUnstartedServer(nil)
	h, err := newConsole(a, consoleConfig{ReadOnly: true, Now: c.now, Hosts: consoleHosts(srv.Listener.Addr(), "127.0.0.1")})
	require.NoError(t, err)
	var mu sync.Mutex
	var mores []url.Values
	srv.Config.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/api/failures" && r.URL.Query().Has("after") {
			mu.Lock()
			mores = append(mores, r.URL.Query())
			mu.Unlock()
		}
		h.ServeHTTP(w, r)
	})
	srv.Start()
	t.Cleanup(srv.Close)
	return srv, func() []url.Values {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(mores)
	}
}

// TestConsoleFailuresAPIPinsAges: /api/failures answers the window it counted
// as absolute times (since, until), an age read against the console's clock to
// the second; sent back with the cursor an hour later, they give the rest of
// the same window, where the ages would read another one.
func TestConsoleFailuresAPIPinsAges(t *testing.T) {
	b := setup(t)
	now := time.Now()
	since := now.Add(-time.Hour).UTC().Truncate(time.Second)
	until := now.Add(-10 * time.Minute).UTC().Truncate(time.Second)
	at := map[string]time.Time{"a": since, "b": since.Add(-time.Millisecond), "c": now.Add(-20 * time.Minute), "d": until}
	for x, n := range map[string]int{"a": 3, "b": 2, "c": 1, "d": 2} {
		_, err := b.pool.Exec(context.Background(), `INSERT INTO inbox (consumer, key, fingerprint, state, expires_at, completed_at, error_code, error)
			SELECT 'failing-'||$1, 'k'||i, '\x00', 'failed', now() + interval '1 day', $2, 'handler', 'declined'
			FROM generate_series(1, $3::int) i`, x, at[x], n)
		require.NoError(t, err)
	}
	var c clock
	c.set(now)
	srv, _ := b.pinnedConsole(t, &c)
	list := func(q url.Values) groupPageJSON {
		t.Helper()
		r := call(t, srv, "GET", "/api/failures?"+q.Encode(), "", nil)
		require.Equal(t, http.StatusOK, r.status, "%s: %s", q.Encode(), r.body)
		var page groupPageJSON
		require.NoError(t, json.Unmarshal(r.body, &page))
		return page
	}
	places := func(p groupPageJSON) []string {
		var out []string
		for _, g := range p.Groups {
			out = append(out, g.Place())
		}
		return out
	}
	first := list(url.Values{"since": {"1h"}, "until": {"10m"}, "limit": {"1"}})
	require.Equal(t, []string{"failing-a"}, places(first))
	require.NotEmpty(t, first.Next)
	require.Equal(t, since, first.Since.UTC())
	require.Equal(t, until, first.Until.UTC())

	c.set(now.Add(time.Hour))
	require.Empty(t, list(url.Values{"since": {"1h"}, "until": {"10m"}, "after": {first.Next}, "limit": {"1"}}).Groups,
		"the ages an hour later are another window")
	// The JSON's own text, as the page sends it back.
	var raw map[string]any
	r := call(t, srv, "GET", "/api/failures?since=1h&until=10m&limit=1", "", nil)
	require.NoError(t, json.Unmarshal(r.body, &raw))
	require.Equal(t, now.UTC().Truncate(time.Second).Format(time.RFC3339), raw["since"], "an hour later, 1h ago is the first page's now")
	second := list(url.Values{"since": {since.Format(time.RFC3339)}, "until": {until.Format(time.RFC3339)}, "after": {first.Next}, "limit": {"1"}})
	require.Equal(t, []string{"failing-c"}, places(second))
	require.Empty(t, second.Next)

	// Without since or until, the answer has neither.
	raw = nil
	r = call(t, srv, "GET", "/api/failures?limit=1", "", nil)
	require.NoError(t, json.Unmarshal(r.body, &raw))
	require.NotContains(t, raw, "since")
	require.NotContains(t, raw, "until")
}

// TestConsoleMorePinsAges: on the Failures page, with "in the last hour"
// chosen, More asks for the next page with the absolute time the first page
// was counted from, so that an hour later it still lists the rest of that
// window (the age, read again, would list nothing); no JavaScript error.
func TestConsoleMorePinsAges(t *testing.T) {
	b := setup(t)
	// 50 groups of two failures, a page's worth, and one of one failure, which
	// comes last in count order.
	_, err := b.pool.Exec(context.Background(), `INSERT INTO inbox (consumer, key, fingerprint, state, expires_at, completed_at, error_code, error)
		SELECT 'failing-'||lpad(g::text, 2, '0'), 'k'||i, '\x00', 'failed', now() + interval '1 day', now() - interval '20 minutes', 'handler', 'declined'
		FROM generate_series(1, 50) g, generate_series(1, 2) i;
		INSERT INTO inbox (consumer, key, fingerprint, state, expires_at, completed_at, error_code, error)
		VALUES ('failing-last', 'k', '\x00', 'failed', now() + interval '1 day', now() - interval '20 minutes', 'handler', 'declined')`)
	require.NoError(t, err)
	now := time.Now()
	var c clock
	c.set(now)
	srv, mores := b.pinnedConsole(t, &c)
	p := openConsole(t, srv.URL+"/#failures")
	const rows = `document.querySelectorAll("#groups tr.group").length`
	p.wait(rows + ` === 50`)
	// The rows are emptied first, so that 50 of them are the filtered page's.
	p.js(`(() => { document.getElementById("groups-since").value = "1h"; document.querySelector("#groups tbody").replaceChildren(); return ""; })()`)
	p.do(chromedp.Click(chromedp.CSS(`#groups-filter button[type=submit]`)))
	p.wait(rows + ` === 50 && !document.getElementById("groups-more").hidden`)

	c.set(now.Add(time.Hour))
	p.click("#groups-more")
	p.wait(rows + ` === 51`)
	require.Equal(t, "failing-last", p.js(`document.querySelector("#groups tr.group:last-child td:nth-child(3)").textContent`))
	got := mores()
	require.Len(t, got, 1)
	require.Equal(t, now.Add(-time.Hour).UTC().Truncate(time.Second).Format(time.RFC3339), got[0].Get("since"))
}
