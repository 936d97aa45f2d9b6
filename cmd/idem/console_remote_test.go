package main

import (
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
)

// A console run with --allow-remote answers nothing of the database without
// its access token: every read and every action gets 401 with problem details.
// The token works as a Bearer header, or traded at POST /api/login for an
// HttpOnly, SameSite=Strict session cookie; the Host check stays on; and the
// server's log never holds the token.
func TestConsoleRemoteNeedsToken(t *testing.T) {
	b := setup(t)
	_, err := b.pool.Exec(context.Background(), seedDead)
	require.NoError(t, err)
	token := strings.Repeat("s3cr3t-", 6)
	var logs lockedBuffer
	srv := b.consoleServerWith(t, consoleConfig{Token: token, Names: []string{"idem.example"},
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})

	// The page's own files, the same in every binary, need no token.
	for _, f := range []string{"/", "/index.html", "/app.js", "/style.css"} {
		require.Equal(t, http.StatusOK, call(t, srv, "GET", f, "", nil).status, f)
	}

	// Reads and actions: no token, a wrong one, a forged cookie.
	forged := (&console{cfg: consoleConfig{Token: strings.Repeat("x", 42)}}).sessionValue(time.Now().Unix())
	expired := (&console{cfg: consoleConfig{Token: token}}).sessionValue(time.Now().Add(-sessionTTL - time.Minute).Unix())
	valid := (&console{cfg: consoleConfig{Token: token}}).sessionValue(time.Now().Unix())
	tampered := valid[:len(valid)-1] + map[bool]string{true: "0", false: "1"}[!strings.HasSuffix(valid, "0")]
	refused := map[string]map[string]string{
		"no token":           nil,
		"wrong token":        {"Authorization": "Bearer " + strings.Repeat("0", len(token))},
		"token and more":     {"Authorization": "Bearer " + token + "x"},
		"token, not bearer":  {"Authorization": "Basic " + token},
		"token in X-Idem":    {tokenHeader: token},
		"another's session":  {"Cookie": sessionCookie + "=" + forged},
		"expired session":    {"Cookie": sessionCookie + "=" + expired},
		"tampered session":   {"Cookie": sessionCookie + "=" + tampered},
		"the token as value": {"Cookie": sessionCookie + "=" + token},
	}
	reads := []string{"/api/session", "/api/stats", "/api/effects?state=dead", "/api/effects?stuck=1",
		"/api/effect?tenant=acme&kind=email&key=receipt:1", "/api/inbox", "/api/inbox/key?consumer=c&key=k",
		"/api/find?key=receipt:1", "/api/activity", "/api/activity?window=day", "/api/failures",
		"/api/failures/group?id=e-0102030405060708", "/favicon.ico"}
	for name, h := range refused {
		for _, path := range reads {
			r := call(t, srv, "GET", path, "", h)
			require.Equal(t, http.StatusUnauthorized, r.status, "%s %s: %s", name, path, r.body)
			require.Equal(t, "unauthorized", r.code(t), "%s %s", name, path)
			require.Equal(t, `Bearer realm="idem console"`, r.header.Get("WWW-Authenticate"))
			require.NotContains(t, string(r.body), token)
		}
		post := map[string]string{"Content-Type": "application/json", tokenHeader: "anything", "Sec-Fetch-Site": "same-origin"}
		for k, v := range h {
			post[k] = v
		}
		r := call(t, srv, "POST", "/api/requeue", `{"tenant": "acme", "kind": "email", "key": "receipt:1"}`, post)
		require.Equal(t, http.StatusUnauthorized, r.status, "%s: %s", name, r.body)
		require.Equal(t, "unauthorized", r.code(t))
		r = call(t, srv, "POST", "/api/failures/action", `{"id": "e-0102030405060708", "action": "retry", "through": "2030-01-01T00:00:00Z", "why": "x"}`, post)
		require.Equal(t, http.StatusUnauthorized, r.status, "%s: %s", name, r.body)
		require.Equal(t, "unauthorized", r.code(t))
	}
	require.Equal(t, 2, pgtest.Count(t, b.pool, `SELECT count(*) FROM effects WHERE state = 'dead'`), "nothing was requeued")

	// The token as a Bearer header: reads, and a requeue with the page's token.
	auth := map[string]string{"Authorization": "Bearer " + token}
	require.Equal(t, http.StatusOK, call(t, srv, "GET", "/api/stats", "", auth).status)
	var session sessionJSON
	require.NoError(t, json.Unmarshal(call(t, srv, "GET", "/api/session", "", auth).body, &session))
	require.Len(t, session.Token, 64)
	require.NotEqual(t, token, session.Token)
	r := call(t, srv, "POST", "/api/requeue", `{"tenant": "acme", "kind": "email", "key": "receipt:1"}`,
		map[string]string{"Authorization": "Bearer " + token, tokenHeader: session.Token, "Sec-Fetch-Site": "same-origin"})
	require.Equal(t, http.StatusOK, r.status, "%s", r.body)
	require.Equal(t, "pending", stateOfEffect(t, b, "acme", "email", "receipt:1"))

	// Login: a wrong token gets no cookie; the right one an HttpOnly,
	// SameSite=Strict cookie (Secure behind a TLS proxy) that opens the API.
	r = call(t, srv, "POST", "/api/login", "", map[string]string{"Authorization": "Bearer nope", "Sec-Fetch-Site": "same-origin"})
	require.Equal(t, http.StatusUnauthorized, r.status)
	require.Empty(t, r.header.Values("Set-Cookie"))
	r = call(t, srv, "POST", "/api/login", "", map[string]string{"Authorization": "Bearer " + token, "Sec-Fetch-Site": "cross-site"})
	require.Equal(t, http.StatusForbidden, r.status, "another site cannot log a browser in")
	r = call(t, srv, "POST", "/api/login", "", map[string]string{"Authorization": "Bearer " + token, "Sec-Fetch-Site": "same-origin"})
	require.Equal(t, http.StatusNoContent, r.status, "%s", r.body)
	cookies := (&http.Response{Header: r.header}).Cookies()
	require.Len(t, cookies, 1)
	ck := cookies[0]
	require.Equal(t, sessionCookie, ck.Name)
	require.True(t, ck.HttpOnly)
	require.Equal(t, http.SameSiteStrictMode, ck.SameSite)
	require.Equal(t, "/", ck.Path)
	require.Equal(t, int(sessionTTL/time.Second), ck.MaxAge)
	require.False(t, ck.Secure, "plain HTTP: a Secure cookie would never come back")
	require.NotContains(t, ck.Value, token)
	withCookie := map[string]string{"Cookie": sessionCookie + "=" + ck.Value}
	require.Equal(t, http.StatusOK, call(t, srv, "GET", "/api/effects?state=dead", "", withCookie).status)
	r = call(t, srv, "POST", "/api/login", "", map[string]string{"Authorization": "Bearer " + token, "X-Forwarded-Proto": "https"})
	require.True(t, (&http.Response{Header: r.header}).Cookies()[0].Secure, "behind a TLS proxy")

	// The Host check stays on, token or not: its own address and the
	// --allow-host names only.
	port := srv.Listener.Addr().String()[strings.LastIndex(srv.Listener.Addr().String(), ":")+1:]
	for _, host := range []string{"evil.example", "evil.example:" + port, "idem.example.evil:" + port} {
		r := call(t, srv, "GET", "/api/stats", "", map[string]string{"Host": host, "Authorization": "Bearer " + token})
		require.Equal(t, http.StatusMisdirectedRequest, r.status, host)
		require.Equal(t, "bad_host", r.code(t))
		require.Equal(t, http.StatusMisdirectedRequest, call(t, srv, "GET", "/", "", map[string]string{"Host": host}).status, host)
	}
	for _, host := range []string{"idem.example", "IDEM.example:8443", "localhost:" + port} {
		require.Equal(t, http.StatusOK, call(t, srv, "GET", "/api/stats", "", map[string]string{"Host": host, "Authorization": "Bearer " + token}).status, host)
	}

	// The server's log (here, the requeue's line) holds neither the token nor a
	// session.
	require.Contains(t, logs.String(), "effect requeued")
	require.NotContains(t, logs.String(), token)
	require.NotContains(t, logs.String(), ck.Value)
}

// consoleRun is an idem console started in-process.
type consoleRun struct {
	stderr *lockedBuffer
	cancel context.CancelFunc
	done   chan int
}

// startConsole runs idem console with args (the test's database appended) and
// waits until it has said where it listens.
func (b *bundle) startConsole(t *testing.T, args ...string) (*consoleRun, string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	c := &consoleRun{stderr: &lockedBuffer{}, cancel: cancel, done: make(chan int, 1)}
	var stdout lockedBuffer
	go func() {
		c.done <- run(ctx, append(append([]string{"console"}, args...), "--database-url", pgtest.URL(), "--schema", b.schema), &stdout, c.stderr)
	}()
	t.Cleanup(func() { c.stop(t) })
	serving := regexp.MustCompile(`idem console: (http://\S+/) \(schema|"msg":"idem console: serving","url":"(http://[^"]+/)"`)
	deadline := time.Now().Add(30 * time.Second)
	for !serving.MatchString(c.stderr.String()) {
		select {
		case code := <-c.done:
			c.done <- code
			t.Fatalf("idem console exited %d: %s", code, c.stderr.String())
		default:
		}
		require.True(t, time.Now().Before(deadline), "the console did not say where it listens: %s", c.stderr.String())
		time.Sleep(20 * time.Millisecond)
	}
	m := serving.FindStringSubmatch(c.stderr.String())
	return c, m[1] + m[2]
}

func (c *consoleRun) stop(t *testing.T) {
	t.Helper()
	c.cancel()
	select {
	case code := <-c.done:
		c.done <- code
		require.Equal(t, exitOK, code, c.stderr.String())
	case <-time.After(30 * time.Second):
		t.Fatal("the console did not stop")
	}
}

func get(t *testing.T, url string, header map[string]string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	require.NoError(t, err)
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer func() { require.NoError(t, resp.Body.Close()) }()
	var p struct {
		Code string `json:"code"`
	}
	_ = json.NewDecoder(resp.Body).Decode(&p)
	return resp.StatusCode, p.Code
}

// idem console --allow-remote warns on stderr and prints the token it made,
// with the URL that signs a browser in; that token opens the API, and nothing
// opens it without. In the default loopback mode no token is asked for.
func TestConsoleRemoteCommand(t *testing.T) {
	b := setup(t)
	c, url := b.startConsole(t, "--addr", "127.0.0.1:0", "--allow-remote", "--allow-host", "idem.example")
	out := c.stderr.String()
	require.Contains(t, out, "WARNING: --allow-remote")
	require.Contains(t, out, "plain HTTP")
	m := regexp.MustCompile(`access token \(generated; set \$IDEM_CONSOLE_TOKEN to choose one\): ([0-9a-f]{64})\n`).FindStringSubmatch(out)
	require.NotNil(t, m, out)
	token := m[1]
	require.Contains(t, out, "open "+url+"#token="+token)
	require.Contains(t, out, "idem.example")

	status, code := get(t, url+"api/stats", nil)
	require.Equal(t, http.StatusUnauthorized, status)
	require.Equal(t, "unauthorized", code)
	status, _ = get(t, url+"api/stats", map[string]string{"Authorization": "Bearer " + token})
	require.Equal(t, http.StatusOK, status)
	c.stop(t)

	// --json: the same, as JSON log lines.
	c, url = b.startConsole(t, "--addr", "127.0.0.1:0", "--allow-remote", "--json")
	var generated string
	for _, line := range strings.Split(strings.TrimSpace(c.stderr.String()), "\n") {
		var l map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &l), "stderr holds JSON only: %s", line)
		if l["level"] == "WARN" {
			require.Contains(t, l["msg"], "--allow-remote")
		}
		if tok, ok := l["token"].(string); ok {
			generated = tok
		}
	}
	require.Len(t, generated, 64)
	status, _ = get(t, url+"api/stats", map[string]string{"Authorization": "Bearer " + generated})
	require.Equal(t, http.StatusOK, status)
	c.stop(t)

	// The default, on loopback: no token.
	c, url = b.startConsole(t, "--addr", "127.0.0.1:0")
	require.NotContains(t, c.stderr.String(), "token")
	require.NotContains(t, c.stderr.String(), "WARNING")
	status, _ = get(t, url+"api/stats", nil)
	require.Equal(t, http.StatusOK, status)
	c.stop(t)

	// Every interface needs the names clients use.
	r := b.idem("console", "--addr", "0.0.0.0:0", "--allow-remote")
	require.Equal(t, exitUsage, r.code, r.stderr)
	require.Contains(t, r.stderr, "--allow-host")
}

// The token from $IDEM_CONSOLE_TOKEN works, and is never printed. (Not
// parallel: it sets the environment.)
func TestConsoleRemoteTokenFromEnv(t *testing.T) {
	pgtest.Require(t)
	pool, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 4})
	b := &bundle{t: t, pool: pool, schema: schema}

	t.Setenv(consoleTokenEnv, "too-short")
	r := b.idem("console", "--addr", "127.0.0.1:0", "--allow-remote")
	require.Equal(t, exitUsage, r.code, r.stderr)
	require.Contains(t, r.stderr, "at least 32")
	require.NotContains(t, r.stderr, "too-short")

	token := "env-" + strings.Repeat("0123456789", 4)
	t.Setenv(consoleTokenEnv, token)
	c, url := b.startConsole(t, "--addr", "127.0.0.1:0", "--allow-remote", "--read-only")
	require.Contains(t, c.stderr.String(), "WARNING: --allow-remote")
	require.Contains(t, c.stderr.String(), "#token=$IDEM_CONSOLE_TOKEN")
	require.NotContains(t, c.stderr.String(), token, "a token from the environment is not printed")
	status, _ := get(t, url+"api/effects?state=dead", map[string]string{"Authorization": "Bearer " + token})
	require.Equal(t, http.StatusOK, status)
	status, code := get(t, url+"api/effects?state=dead", map[string]string{"Authorization": "Bearer " + token[:len(token)-1]})
	require.Equal(t, http.StatusUnauthorized, status)
	require.Equal(t, "unauthorized", code)
	c.stop(t)
	require.NotContains(t, c.stderr.String(), token)
}
