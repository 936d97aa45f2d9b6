package httpidem_test

import (
	"errors"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/httpidem"
	"github.com/idemkit/idem/internal/errcode"
)

// TestScopeMustBeChosen: New refuses a config that names neither a Tenant function
// nor Unscoped, and one that names both, with ErrScopeNotChosen saying what to set
// and why.
func TestScopeMustBeChosen(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for name, mutate := range map[string]func(*httpidem.Config){
		"neither": func(c *httpidem.Config) { c.Tenant = nil },
		"both":    func(c *httpidem.Config) { c.Unscoped = true },
	} {
		cfg := baseConfig(b.pool, b.schema)
		mutate(&cfg)
		_, err := httpidem.New(cfg)
		require.ErrorIs(t, err, httpidem.ErrScopeNotChosen, name)
		require.ErrorContains(t, err, "invalid config", name)
		require.ErrorContains(t, err, "Config.Tenant", name)
		require.ErrorContains(t, err, "Config.Unscoped", name)
		var coded *errcode.Error
		require.True(t, errors.As(err, &coded), name)
		require.Equal(t, "scope_not_chosen", coded.Code())
		require.ErrorIs(t, cfg.Validate(), httpidem.ErrScopeNotChosen, name)
	}
}

// TestUnscoped: with Unscoped, keys are one space for every client, on purpose:
// another client's equal key and request get the first client's stored answer.
func TestUnscoped(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *httpidem.Config) { c.Tenant = nil; c.Unscoped = true })
	first := b.post(t, "/payments", "shared", `{"amount": 1}`, "X-Tenant", "acme")
	require.Equal(t, http.StatusCreated, first.Status)
	requireSameAnswer(t, first, b.post(t, "/payments", "shared", `{"amount": 1}`, "X-Tenant", "globex"))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM inbox WHERE tenant = ''`))
	require.Equal(t, 1, b.payments(t))
}

// TestEmptyTenantRefused: a Tenant function that returns "" (no principal) is
// refused with 400 tenant_invalid before anything runs: "" is the unscoped space,
// which only Unscoped chooses.
func TestEmptyTenantRefused(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, path := range []string{"/payments", "/leased/payments"} {
		problem(t, b.post(t, path, "k", `{"amount": 1}`, "X-Tenant", ""), http.StatusBadRequest, httpidem.CodeTenantInvalid)
	}
	require.EqualValues(t, 0, b.calls.Load())
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM inbox`))
}

// TestSensitiveHeaders: StoredHeaders naming a header that carries credentials is
// refused (ErrSensitiveHeader) unless StoreSensitiveHeaders allows it. By default
// Set-Cookie is on the first answer only; allowed, it is replayed.
func TestSensitiveHeaders(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, h := range []string{"Set-Cookie", "authorization", "Proxy-Authorization", "cookie"} {
		cfg := baseConfig(b.pool, b.schema)
		cfg.StoredHeaders = append([]string{"Content-Type"}, h)
		_, err := httpidem.New(cfg)
		require.ErrorIs(t, err, httpidem.ErrSensitiveHeader, h)
		require.ErrorContains(t, err, h)
		require.ErrorContains(t, err, "StoreSensitiveHeaders")
	}

	cookie := func(w http.ResponseWriter, r *http.Request) bool {
		http.SetCookie(w, &http.Cookie{Name: "session", Value: "s3cr3t"})
		return false
	}
	b.setHook(cookie)
	first := b.post(t, "/payments", "k", `{"amount": 1}`)
	require.Equal(t, "session=s3cr3t", first.Header.Get("Set-Cookie"))
	replay := b.post(t, "/payments", "k", `{"amount": 1}`)
	requireSameAnswer(t, first, replay)
	require.Empty(t, replay.Header.Get("Set-Cookie"), "never stored by default")
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM inbox WHERE position('s3cr3t' in convert_from(response_headers, 'UTF8')) > 0`))

	allowed := setup(t, func(c *httpidem.Config) {
		c.StoredHeaders = append(append([]string{}, httpidem.DefaultStoredHeaders...), "Set-Cookie")
		c.StoreSensitiveHeaders = true
	})
	allowed.setHook(cookie)
	first = allowed.post(t, "/payments", "k", `{"amount": 1}`)
	replay = allowed.post(t, "/payments", "k", `{"amount": 1}`)
	requireSameAnswer(t, first, replay)
	require.Equal(t, "session=s3cr3t", replay.Header.Get("Set-Cookie"))
}

// TestCacheControlReplayed: Cache-Control is stored and replayed by default, so
// that a replay is cached (or not) as the first answer was.
func TestCacheControlReplayed(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.setHook(func(w http.ResponseWriter, r *http.Request) bool {
		w.Header().Set("Cache-Control", "no-store")
		return false
	})
	first := b.post(t, "/payments", "k", `{"amount": 1}`)
	require.Equal(t, "no-store", first.Header.Get("Cache-Control"))
	replay := b.post(t, "/payments", "k", `{"amount": 1}`)
	requireSameAnswer(t, first, replay)
	require.Equal(t, "no-store", replay.Header.Get("Cache-Control"))
}

// TestSafeMethodsPassThrough: a GET or HEAD on a wrapped route passes through
// untouched (no transaction, nothing stored, run every time), key or not; a GET and
// a HEAD with one key are two reads, never a mismatch. A route that asks for keys
// (Route.SafeMethods) runs them through idem like any other request.
func TestSafeMethodsPassThrough(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var reads atomic.Int64
	read := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := reads.Add(1)
		if tx, err := httpidem.TxSafely(r.Context()); err == nil {
			if _, err := tx.Exec(r.Context(), `INSERT INTO audit (note) VALUES ('read')`); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
		}
		w.Header().Set("Content-Type", "text/plain")
		_, _ = w.Write([]byte(strings.Repeat("r", int(n))))
	})
	mux := http.NewServeMux()
	mux.Handle("GET /balance", b.mw.Middleware(read))
	mux.Handle("GET /report", b.mw.Route(httpidem.Route{SafeMethods: true})(read))
	srv := newServer(t, mux)
	do := func(method, path, key string) answer {
		req, err := http.NewRequest(method, srv.URL+path, nil)
		require.NoError(t, err)
		req.Header.Set("X-Tenant", defaultTenant)
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		resp, err := srv.Client().Do(req)
		require.NoError(t, err)
		defer func() { require.NoError(t, resp.Body.Close()) }()
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return answer{Status: resp.StatusCode, Header: resp.Header, Body: body, Replayed: resp.Header.Get(httpidem.ReplayedHeader) == "true"}
	}

	require.Equal(t, "r", string(do(http.MethodGet, "/balance", "").Body), "no key needed")
	require.Equal(t, "rr", string(do(http.MethodGet, "/balance", "k").Body), "the key is ignored")
	again := do(http.MethodGet, "/balance", "k")
	require.Equal(t, "rrr", string(again.Body), "run again, never a stale replay")
	require.False(t, again.Replayed)
	head := do(http.MethodHead, "/balance", "k")
	require.Equal(t, http.StatusOK, head.Status, "a HEAD with the GET's key is another read, not 422")
	require.EqualValues(t, 4, reads.Load())
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM inbox`))
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM audit`), "no transaction was given")

	// A route that asks for keys: keyed, in a transaction, stored and replayed.
	problem(t, do(http.MethodGet, "/report", ""), http.StatusBadRequest, httpidem.CodeKeyMissing)
	first := do(http.MethodGet, "/report", "r1")
	require.Equal(t, strings.Repeat("r", 5), string(first.Body))
	requireSameAnswer(t, first, do(http.MethodGet, "/report", "r1"))
	require.EqualValues(t, 5, reads.Load())
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM inbox WHERE consumer = 'GET /report' AND response_status = 200`))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM audit`))
}
