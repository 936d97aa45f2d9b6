package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/httpidem"
	"github.com/idemkit/idem/internal/pgtest"
)

// consoleServer serves the console for b's schema on a loopback port.
func (b *bundle) consoleServer(t *testing.T, readOnly bool) *httptest.Server {
	t.Helper()
	return b.consoleServerWith(t, consoleConfig{ReadOnly: readOnly})
}

// consoleServerWith serves the console with cfg, its Hosts those of its
// loopback port.
func (b *bundle) consoleServerWith(t *testing.T, cfg consoleConfig) *httptest.Server {
	t.Helper()
	a, err := admin.New(admin.Config{Pool: b.pool, Schema: b.schema})
	require.NoError(t, err)
	srv := httptest.NewUnstartedServer(nil)
	cfg.Hosts = consoleHosts(srv.Listener.Addr(), "127.0.0.1")
	h, err := newConsole(a, cfg)
	require.NoError(t, err)
	srv.Config.Handler = h
	srv.Start()
	t.Cleanup(srv.Close)
	return srv
}

type apiResult struct {
	status int
	header http.Header
	body   []byte
}

func call(t *testing.T, srv *httptest.Server, method, path string, body string, header map[string]string) apiResult {
	t.Helper()
	req, err := http.NewRequest(method, srv.URL+path, strings.NewReader(body))
	require.NoError(t, err)
	for k, v := range header {
		if k == "Host" {
			req.Host = v
			continue
		}
		req.Header.Set(k, v)
	}
	resp, err := srv.Client().Do(req)
	require.NoError(t, err)
	defer func() { require.NoError(t, resp.Body.Close()) }()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return apiResult{status: resp.StatusCode, header: resp.Header, body: b}
}

// code is the problem's code; every error is RFC 9457 problem details.
func (r apiResult) code(t *testing.T) string {
	t.Helper()
	require.Equal(t, "application/problem+json", r.header.Get("Content-Type"), "%s", r.body)
	var p httpidem.Problem
	require.NoError(t, json.Unmarshal(r.body, &p), "%s", r.body)
	require.Equal(t, r.status, p.Status)
	require.Equal(t, httpidem.ProblemTypePrefix+p.Code, p.Type)
	require.NotEmpty(t, p.Detail)
	return p.Code
}

const seedDead = `INSERT INTO effects (tenant, kind, key, fingerprint, state, attempts, last_error, created_at) VALUES
	('acme', 'email', 'receipt:1', '\x00', 'dead', 25, E'smtp: 550 <script>window.pwned=1</script> \\x00 \x01', now() - interval '2 minutes'),
	('', 'email', 'receipt:1', '\x00', 'dead', 25, 'boom', now() - interval '1 minute'),
	('acme', 'email', 'receipt:2', '\x00', 'pending', 5, 'timeout', now())`

func TestConsoleAPI(t *testing.T) {
	b := setup(t)
	_, err := b.pool.Exec(context.Background(), seedDead)
	require.NoError(t, err)
	srv := b.consoleServer(t, false)

	page := call(t, srv, "GET", "/", "", nil)
	require.Equal(t, http.StatusOK, page.status)
	require.Contains(t, string(page.body), `<script src="app.js" defer></script>`)
	require.Contains(t, page.header.Get("Content-Security-Policy"), "script-src 'self'")
	require.Equal(t, "DENY", page.header.Get("X-Frame-Options"))
	for _, f := range []string{"/app.js", "/style.css"} {
		require.Equal(t, http.StatusOK, call(t, srv, "GET", f, "", nil).status, f)
	}
	require.NotContains(t, string(page.body)+string(call(t, srv, "GET", "/style.css", "", nil).body), "http", "no CDN, no external font")

	var session sessionJSON
	require.NoError(t, json.Unmarshal(call(t, srv, "GET", "/api/session", "", nil).body, &session))
	require.Equal(t, b.schema, session.Schema)
	require.False(t, session.ReadOnly)
	require.Len(t, session.Token, 64)

	// Lists: the last error comes back as it is stored, JSON-escaped (Go's
	// encoder writes < and > as \u003c and \u003e, so no browser sniffs it as HTML).
	r := call(t, srv, "GET", "/api/effects?state=dead", "", nil)
	require.Equal(t, http.StatusOK, r.status)
	require.Contains(t, string(r.body), `\u003cscript\u003e`)
	require.NotContains(t, string(r.body), `<script>`)
	var dead effectPageJSON
	require.NoError(t, json.Unmarshal(r.body, &dead))
	require.Len(t, dead.Effects, 2)
	require.Equal(t, "smtp: 550 <script>window.pwned=1</script> \\x00 \x01", dead.Effects[1].LastError)
	var stuck effectPageJSON
	require.NoError(t, json.Unmarshal(call(t, srv, "GET", "/api/effects?stuck=1", "", nil).body, &stuck))
	require.Len(t, stuck.Effects, 1)
	require.Contains(t, stuck.Effects[0].Stuck, "5 of 25 attempts")
	var onePage effectPageJSON
	require.NoError(t, json.Unmarshal(call(t, srv, "GET", "/api/effects?state=dead&tenant=&limit=1", "", nil).body, &onePage))
	require.Len(t, onePage.Effects, 1)
	require.Equal(t, "", onePage.Effects[0].Tenant, "tenant= is the unscoped tenant")
	require.Equal(t, "bad_cursor", call(t, srv, "GET", "/api/effects?after=nope", "", nil).code(t))
	require.Equal(t, http.StatusBadRequest, call(t, srv, "GET", "/api/effects?limit=x", "", nil).status)
	require.Equal(t, http.StatusNotFound, call(t, srv, "GET", "/api/effect?kind=email&key=nope", "", nil).status)
	var found admin.Found
	require.NoError(t, json.Unmarshal(call(t, srv, "GET", "/api/find?key=receipt:1", "", nil).body, &found))
	require.Len(t, found.Effects, 2)
	require.Equal(t, http.StatusBadRequest, call(t, srv, "GET", "/api/find?key=", "", nil).status)

	// Requeue: only same-origin, with the token.
	body := `{"tenant": "acme", "kind": "email", "key": "receipt:1"}`
	good := map[string]string{"Content-Type": "application/json", tokenHeader: session.Token, "Sec-Fetch-Site": "same-origin"}
	for name, h := range map[string]map[string]string{
		"no token":          {"Content-Type": "application/json"},
		"wrong token":       {tokenHeader: strings.Repeat("0", 64)},
		"cross-site":        {tokenHeader: session.Token, "Sec-Fetch-Site": "cross-site"},
		"other origin":      {tokenHeader: session.Token, "Origin": "http://evil.example"},
		"other site, no SF": {"Origin": "http://evil.example"},
	} {
		r := call(t, srv, "POST", "/api/requeue", body, h)
		require.Equal(t, http.StatusForbidden, r.status, "%s: %s", name, r.body)
	}
	require.Equal(t, 2, pgtest.Count(t, b.pool, `SELECT count(*) FROM effects WHERE state = 'dead'`), "nothing was requeued")
	r = call(t, srv, "POST", "/api/requeue", body, good)
	require.Equal(t, http.StatusOK, r.status, "%s", r.body)
	var e admin.Effect
	require.NoError(t, json.Unmarshal(r.body, &e))
	require.Equal(t, "pending", e.State)
	require.Equal(t, "dead", stateOfEffect(t, b, "", "email", "receipt:1"), "the unscoped effect of the same key stays dead")
	r = call(t, srv, "POST", "/api/requeue", body, good)
	require.Equal(t, http.StatusConflict, r.status)
	require.Equal(t, "not_dead", r.code(t))
	require.Equal(t, http.StatusNotFound, call(t, srv, "POST", "/api/requeue", `{"kind": "email", "key": "nope"}`, good).status)
	require.Equal(t, http.StatusBadRequest, call(t, srv, "POST", "/api/requeue", `{"kind": "email"}`, good).status)
	require.Equal(t, http.StatusBadRequest, call(t, srv, "POST", "/api/requeue", `{"kind": "email", "key": "k", "extra": 1}`, good).status)
	require.Equal(t, http.StatusNotFound, call(t, srv, "GET", "/api/requeue", "", nil).status, "a GET never requeues")

	// DNS rebinding: a page of another name pointed at 127.0.0.1 is refused.
	r = call(t, srv, "GET", "/api/stats", "", map[string]string{"Host": "evil.example:80"})
	require.Equal(t, http.StatusMisdirectedRequest, r.status)
	require.Equal(t, "bad_host", r.code(t))
	_, port, _ := strings.Cut(srv.Listener.Addr().String(), ":")
	require.Equal(t, http.StatusOK, call(t, srv, "GET", "/api/stats", "", map[string]string{"Host": "localhost:" + port}).status)
}

func stateOfEffect(t *testing.T, b *bundle, tenant, kind, key string) string {
	t.Helper()
	var s string
	require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT state FROM effects WHERE tenant = $1 AND kind = $2 AND key = $3`, tenant, kind, key).Scan(&s))
	return s
}

func TestConsoleReadOnly(t *testing.T) {
	b := setup(t)
	_, err := b.pool.Exec(context.Background(), seedDead)
	require.NoError(t, err)
	srv := b.consoleServer(t, true)
	var session sessionJSON
	require.NoError(t, json.Unmarshal(call(t, srv, "GET", "/api/session", "", nil).body, &session))
	require.True(t, session.ReadOnly)
	require.Empty(t, session.Token, "a read-only console hands out no token")
	// Refused on the server, whatever the request carries.
	rw := b.consoleServer(t, false)
	var rwSession sessionJSON
	require.NoError(t, json.Unmarshal(call(t, rw, "GET", "/api/session", "", nil).body, &rwSession))
	r := call(t, srv, "POST", "/api/requeue", `{"tenant": "acme", "kind": "email", "key": "receipt:1"}`,
		map[string]string{tokenHeader: rwSession.Token, "Sec-Fetch-Site": "same-origin"})
	require.Equal(t, http.StatusForbidden, r.status)
	require.Equal(t, "read_only", r.code(t))
	require.Equal(t, "dead", stateOfEffect(t, b, "acme", "email", "receipt:1"))
	require.Equal(t, http.StatusOK, call(t, srv, "GET", "/api/effects?state=dead", "", nil).status)
}

// lockedBuffer is a bytes.Buffer that a goroutine writes while the test reads.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// idem console itself: it listens on loopback, says where, serves, and stops on
// the signal (the context); a non-loopback address is refused unless asked for.
func TestConsoleCommand(t *testing.T) {
	b := setup(t)
	ctx, cancel := context.WithCancel(context.Background())
	var stdout, stderr lockedBuffer
	done := make(chan int, 1)
	go func() {
		done <- run(ctx, []string{"console", "--addr", "127.0.0.1:0", "--read-only", "--database-url", pgtest.URL(), "--schema", b.schema}, &stdout, &stderr)
	}()
	url := regexp.MustCompile(`http://127\.0\.0\.1:\d+/`)
	deadline := time.Now().Add(30 * time.Second)
	for !url.MatchString(stderr.String()) {
		require.True(t, time.Now().Before(deadline), "the console did not say where it listens: %s", stderr.String())
		time.Sleep(20 * time.Millisecond)
	}
	require.Contains(t, stderr.String(), "read-only")
	resp, err := http.Get(url.FindString(stderr.String()) + "api/stats")
	require.NoError(t, err)
	var s admin.Stats
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&s))
	require.NoError(t, resp.Body.Close())
	require.Equal(t, b.schema, s.Schema)
	cancel()
	select {
	case code := <-done:
		require.Equal(t, exitOK, code, stderr.String())
	case <-time.After(30 * time.Second):
		t.Fatal("the console did not stop")
	}

	for _, addr := range []string{"0.0.0.0:8080", ":8080", "192.0.2.1:8080", "example.com:80"} {
		r := b.idem("console", "--addr", addr)
		require.Equal(t, exitUsage, r.code, addr)
		require.Contains(t, r.stderr, "not a loopback address", addr)
	}
	r := b.idem("console", "--addr", "nonsense")
	require.Equal(t, exitUsage, r.code)
	require.True(t, isLoopback("::1") && isLoopback("localhost") && isLoopback("127.0.0.2") && !isLoopback(""))
}
