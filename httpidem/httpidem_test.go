package httpidem_test

import (
	"context"
	"encoding/hex"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/httpidem"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/janitor"
)

// TestReplayAfterSuccess: the second request with the key runs nothing and gets
// the first answer byte for byte, with Idempotent-Replayed; a header outside the
// allow-list is on the first answer only. The payment's effect carries the
// request's identity.
func TestReplayAfterSuccess(t *testing.T) {
	t.Parallel()
	b := setup(t)
	first := b.post(t, "/payments", "key-1", `{"amount": 12.50, "email": "ann@example.com"}`, "X-Tenant", "acme")
	require.Equal(t, http.StatusCreated, first.Status, "%s", first)
	require.Equal(t, "{\"id\":1,\"amount\":\"12.50\"}\n", string(first.Body))
	require.Equal(t, "/payments/1", first.Header.Get("Location"))
	require.NotEmpty(t, first.Header.Get("X-Served-At"))

	// Key order, whitespace and number form are the same command.
	replay := b.post(t, "/payments", "key-1", `{"email":"ann@example.com","amount":1.250e1}`, "X-Tenant", "acme")
	requireSameAnswer(t, first, replay)
	require.Empty(t, replay.Header.Get("X-Served-At"), "not in StoredHeaders")
	require.Equal(t, 1, b.payments(t))
	require.EqualValues(t, 1, b.calls.Load())
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM effects WHERE kind = 'email' AND source_consumer = 'POST /payments'
		AND source_tenant = 'acme' AND source_key = 'key-1'`))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM inbox WHERE state = 'completed' AND response_status = 201`))
	// A different key is a different payment.
	second := b.post(t, "/payments", "key-2", `{"amount": 12.50}`, "X-Tenant", "acme")
	require.Equal(t, "{\"id\":2,\"amount\":\"12.50\"}\n", string(second.Body))
	require.Equal(t, 2, b.payments(t))
}

// TestSameKeyDifferentRequest: a changed amount (a large number included, which
// a double cannot tell apart), path or method under one key is 422 and runs
// nothing, and the key still replays its first answer.
func TestSameKeyDifferentRequest(t *testing.T) {
	t.Parallel()
	b := setup(t)
	first := b.post(t, "/payments", "k", `{"amount": 9007199254740993}`)
	require.Equal(t, http.StatusCreated, first.Status, "%s", first)
	require.Equal(t, "{\"id\":1,\"amount\":\"9007199254740993\"}\n", string(first.Body))

	for _, body := range []string{`{"amount": 9007199254740992}`, `{"amount": 9007199254740993.0000000001}`, `{"amount": 9007199254740993, "email": "x@y"}`} {
		a := b.post(t, "/payments", "k", body)
		p := problem(t, a, http.StatusUnprocessableEntity, httpidem.CodeFingerprintMismatch)
		require.Contains(t, p.Detail, "different request")
	}
	// The same key on another account is another command of the same operation.
	a := b.post(t, "/accounts/7/payments", "k", `{"amount": 1}`)
	require.Equal(t, http.StatusCreated, a.Status)
	a = b.post(t, "/accounts/8/payments", "k", `{"amount": 1}`)
	problem(t, a, http.StatusUnprocessableEntity, httpidem.CodeFingerprintMismatch)

	requireSameAnswer(t, first, b.post(t, "/payments", "k", `{"amount":9007199254740993e0}`))
	require.Equal(t, 2, b.payments(t))
	require.EqualValues(t, 2, b.calls.Load())
	require.Equal(t, float64(4), counter(t, b.reg, "idem_http_requests_total", "POST /payments", "mismatch")+
		counter(t, b.reg, "idem_http_requests_total", "POST /accounts/{acct}/payments", "mismatch"))
}

// TestConcurrentRequestsOneKey: 20 requests with one key at once. One runs and
// commits; every other one waits for it and replays its answer, or gets 409 with
// Retry-After if the wait ran out. Never a second payment.
func TestConcurrentRequestsOneKey(t *testing.T) {
	t.Parallel()
	b := setup(t)
	release := make(chan struct{})
	b.setHook(func(http.ResponseWriter, *http.Request) bool { <-release; return false })
	const n = 20
	answers := make([]answer, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			answers[i], errs[i] = b.tryPost(context.Background(), "/payments", "same", `{"amount": 5}`)
		})
	}
	// Every request is in: one in the handler, the others waiting on its key.
	pgtest.WaitFor(t, 30*time.Second, "the 19 others to wait on the key", func() bool {
		return b.count(t, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND application_name = $1`, "idem-test:"+b.schema) == n-1
	})
	close(release)
	wg.Wait()
	var committed, replayed, busy int
	var first answer
	for i, a := range answers {
		require.NoError(t, errs[i])
		switch {
		case a.Status == http.StatusCreated && !a.Replayed:
			committed++
			first = a
		case a.Replayed:
			replayed++
		default:
			problem(t, a, http.StatusConflict, httpidem.CodeInProgress)
			require.Equal(t, "1", a.Header.Get("Retry-After"))
			busy++
		}
	}
	require.Equal(t, 1, committed)
	require.Equal(t, n-1, replayed+busy)
	for _, a := range answers {
		if a.Replayed {
			requireSameAnswer(t, first, a)
		}
	}
	require.Equal(t, 1, b.payments(t))
	require.EqualValues(t, 1, b.calls.Load())
}

// TestConcurrentPastWait: a request that outwaits LockTimeout gets 409 + Retry-After and
// runs nothing; the key then replays.
func TestConcurrentPastWait(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *httpidem.Config) { c.LockTimeout = 50 * time.Millisecond; c.RetryAfter = 3 * time.Second })
	entered, release := make(chan struct{}), make(chan struct{})
	b.setHook(func(http.ResponseWriter, *http.Request) bool { close(entered); <-release; return false })
	done := make(chan answer)
	go func() { done <- b.post(t, "/payments", "slow", `{"amount": 5}`) }()
	<-entered
	a := b.post(t, "/payments", "slow", `{"amount": 5}`)
	problem(t, a, http.StatusConflict, httpidem.CodeInProgress)
	require.Equal(t, "3", a.Header.Get("Retry-After"))
	close(release)
	first := <-done
	require.Equal(t, http.StatusCreated, first.Status)
	requireSameAnswer(t, first, b.post(t, "/payments", "slow", `{"amount": 5}`))
	require.Equal(t, 1, b.payments(t))
}

// TestServerErrorThenRetry: a 500 after the payment row was written rolls it back
// and stores nothing; the retry runs again and succeeds, and that is what replays.
func TestServerErrorThenRetry(t *testing.T) {
	t.Parallel()
	b := setup(t)
	fail := true
	b.setHook(func(w http.ResponseWriter, r *http.Request) bool {
		if fail {
			fail = false
			http.Error(w, "provider down", http.StatusInternalServerError)
			return true
		}
		return false
	})
	a := b.post(t, "/payments", "k", `{"amount": 3}`)
	require.Equal(t, http.StatusInternalServerError, a.Status)
	require.Equal(t, "provider down\n", string(a.Body), "the handler's 500 reaches the client as it wrote it")
	require.Equal(t, 0, b.payments(t))
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM inbox`))
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM effects`))

	second := b.post(t, "/payments", "k", `{"amount": 3}`)
	require.Equal(t, http.StatusCreated, second.Status)
	require.False(t, second.Replayed)
	requireSameAnswer(t, second, b.post(t, "/payments", "k", `{"amount": 3}`))
	require.Equal(t, 1, b.payments(t))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM effects`))
	require.EqualValues(t, 2, b.calls.Load())
	require.Equal(t, float64(1), counter(t, b.reg, "idem_http_requests_total", "POST /payments", "not_final"))
}

// TestValidationErrorStoredAndReplayed: a 422 is final: the handler's writes
// (an audit row) roll back, the answer is stored as failed and replayed; a 400
// likewise. Neither runs the handler again.
func TestValidationErrorStoredAndReplayed(t *testing.T) {
	t.Parallel()
	b := setup(t)
	first := b.post(t, "/payments", "bad", `{"amount": -5}`)
	require.Equal(t, http.StatusUnprocessableEntity, first.Status)
	require.Equal(t, `{"error":"amount must be positive"}`, string(first.Body))
	replay := b.post(t, "/payments", "bad", `{"amount": -5}`)
	requireSameAnswer(t, first, replay)
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM audit`), "the handler's work rolled back")
	require.Equal(t, 0, b.payments(t))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM inbox WHERE state = 'failed' AND error_code = 'http_422' AND response_status = 422`))

	first = b.post(t, "/payments", "bad2", `{"nope": 1}`)
	require.Equal(t, http.StatusBadRequest, first.Status)
	requireSameAnswer(t, first, b.post(t, "/payments", "bad2", `{"nope": 1}`))
	require.EqualValues(t, 2, b.calls.Load())

	// A 409 from the handler is not final: rolled back, not stored, run again.
	b.setHook(func(w http.ResponseWriter, r *http.Request) bool {
		w.WriteHeader(http.StatusConflict)
		return true
	})
	require.Equal(t, http.StatusConflict, b.post(t, "/payments", "c", `{"amount": 1}`).Status)
	require.Equal(t, http.StatusConflict, b.post(t, "/payments", "c", `{"amount": 1}`).Status)
	require.EqualValues(t, 4, b.calls.Load())
	require.Equal(t, 0, b.payments(t))
}

// TestExpiredKey: a key past its retention is forgotten: the request runs again as
// new, whether or not the janitor came; the janitor deletes the key with its
// stored response.
func TestExpiredKey(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	first := b.post(t, "/payments", "old", `{"amount": 1}`)
	require.Equal(t, http.StatusCreated, first.Status)
	_, err := b.pool.Exec(ctx, `UPDATE inbox SET expires_at = now() - interval '1 second'`)
	require.NoError(t, err)

	again := b.post(t, "/payments", "old", `{"amount": 2}`)
	require.Equal(t, http.StatusCreated, again.Status)
	require.False(t, again.Replayed)
	require.Equal(t, "{\"id\":2,\"amount\":\"2\"}\n", string(again.Body))
	require.Equal(t, 2, b.payments(t))
	require.Equal(t, float64(1), counter(t, b.reg, "idem_http_expired_keys_total", "POST /payments", ""))
	requireSameAnswer(t, again, b.post(t, "/payments", "old", `{"amount": 2}`))

	// The janitor deletes an expired key and its response.
	_, err = b.pool.Exec(ctx, `UPDATE inbox SET expires_at = now() - interval '1 second'`)
	require.NoError(t, err)
	j, err := janitor.New(janitor.Config{Pool: b.pool, Schema: b.schema})
	require.NoError(t, err)
	st, err := j.RunOnce(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, st.InboxDeleted)
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM inbox`))
	third := b.post(t, "/payments", "old", `{"amount": 2}`)
	require.Equal(t, "{\"id\":3,\"amount\":\"2\"}\n", string(third.Body))
	require.Equal(t, 3, b.payments(t))
}

// TestTwoTenantsOneKey: the tenant is part of the key; two tenants' equal keys are
// two payments, each replaying its own answer, and a tenant never sees the other's.
func TestTwoTenantsOneKey(t *testing.T) {
	t.Parallel()
	b := setup(t)
	acme := b.post(t, "/payments", "shared", `{"amount": 1}`, "X-Tenant", "acme")
	globex := b.post(t, "/payments", "shared", `{"amount": 2}`, "X-Tenant", "globex")
	require.Equal(t, "{\"id\":1,\"amount\":\"1\"}\n", string(acme.Body))
	require.Equal(t, "{\"id\":2,\"amount\":\"2\"}\n", string(globex.Body))
	requireSameAnswer(t, acme, b.post(t, "/payments", "shared", `{"amount": 1}`, "X-Tenant", "acme"))
	requireSameAnswer(t, globex, b.post(t, "/payments", "shared", `{"amount": 2}`, "X-Tenant", "globex"))
	require.Equal(t, 2, b.payments(t))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM payments WHERE tenant = 'acme'`))
	require.Equal(t, 2, b.count(t, `SELECT count(*) FROM inbox WHERE key = 'shared'`))

	// An invalid tenant is refused before anything runs.
	a := b.post(t, "/payments", "k", `{"amount": 1}`, "X-Tenant", strings.Repeat("t", inbox.MaxKeyLen+1))
	problem(t, a, http.StatusBadRequest, httpidem.CodeTenantInvalid)
	require.Equal(t, 2, b.payments(t))
}

// TestBodyOverLimit: a request body over MaxRequestBody is 413 before anything
// runs; a response over MaxResponseBody rolls the work back and answers 500,
// every time, since it cannot be stored.
func TestBodyOverLimit(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *httpidem.Config) { c.MaxRequestBody = 64; c.MaxResponseBody = 100 })
	big := `{"amount": 1, "email": "` + strings.Repeat("a", 64) + `"}`
	a := b.post(t, "/payments", "k", big)
	p := problem(t, a, http.StatusRequestEntityTooLarge, httpidem.CodeRequestTooLarge)
	require.Contains(t, p.Detail, "64 bytes")
	require.EqualValues(t, 0, b.calls.Load())
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM inbox`))

	b.setHook(func(w http.ResponseWriter, r *http.Request) bool {
		w.WriteHeader(http.StatusCreated)
		for range 20 {
			_, _ = w.Write([]byte("0123456789"))
		}
		return true
	})
	for range 2 {
		a = b.post(t, "/payments", "k2", `{"amount": 1}`)
		problem(t, a, http.StatusInternalServerError, httpidem.CodeResponseTooLarge)
	}
	require.EqualValues(t, 2, b.calls.Load())
	require.Equal(t, 0, b.payments(t))
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM inbox`))

	// Exactly at the limit is stored.
	b.setHook(func(w http.ResponseWriter, r *http.Request) bool {
		_, _ = w.Write([]byte(strings.Repeat("x", 100)))
		return true
	})
	first := b.post(t, "/payments", "k3", `{"amount": 1}`)
	require.Equal(t, 200, first.Status)
	require.Equal(t, "text/plain; charset=utf-8", first.Header.Get("Content-Type"), "sniffed once, stored, replayed")
	requireSameAnswer(t, first, b.post(t, "/payments", "k3", `{"amount": 1}`))
}

// TestClientDisconnects: a client that goes away after the handler wrote its rows
// and before the commit gets nothing stored; its retry runs the handler again.
func TestClientDisconnects(t *testing.T) {
	t.Parallel()
	b := setup(t)
	inHandler := make(chan struct{})
	b.setHook(func(w http.ResponseWriter, r *http.Request) bool {
		close(inHandler)
		<-r.Context().Done() // the payment row is written; now the client leaves
		return false         // and the handler answers 201 as if nothing happened
	})
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		_, err := b.tryPost(ctx, "/payments", "gone", `{"amount": 4}`)
		errc <- err
	}()
	<-inHandler
	cancel()
	require.ErrorIs(t, <-errc, context.Canceled)
	pgtest.WaitFor(t, 30*time.Second, "the rollback to be counted", func() bool {
		return counter(t, b.reg, "idem_http_requests_total", "POST /payments", "disconnected") == 1
	})
	require.Equal(t, 0, b.payments(t))
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM inbox`))
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM effects`))

	b.setHook(nil)
	a := b.post(t, "/payments", "gone", `{"amount": 4}`)
	require.Equal(t, http.StatusCreated, a.Status)
	require.False(t, a.Replayed)
	require.Equal(t, "{\"id\":2,\"amount\":\"4\"}\n", string(a.Body), "id 1 was the rolled-back row's")
	require.Equal(t, 1, b.payments(t))
}

// TestDeadlineRollsBack: a request whose deadline passes before the commit is
// rolled back and answered 503 with Retry-After.
func TestDeadlineRollsBack(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.setHook(func(w http.ResponseWriter, r *http.Request) bool {
		<-r.Context().Done()
		return false
	})
	mux := http.NewServeMux()
	mux.Handle("POST /payments", b.mw.Middleware(http.HandlerFunc(b.handler)))
	timed := func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 200*time.Millisecond)
		defer cancel()
		mux.ServeHTTP(w, r.WithContext(ctx))
	}
	srv := newServer(t, http.HandlerFunc(timed))
	a, err := postTo(context.Background(), srv.Client(), srv.URL, "/payments", "slow", `{"amount": 1}`)
	require.NoError(t, err)
	problem(t, a, http.StatusServiceUnavailable, httpidem.CodeTimeout)
	require.NotEmpty(t, a.Header.Get("Retry-After"))
	require.Equal(t, 0, b.payments(t))
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM inbox`))
}

// TestPanicRollsBack: a panicking handler stores nothing; the panic goes on to
// net/http (the connection is dropped), and the retry runs again.
func TestPanicRollsBack(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.setHook(func(http.ResponseWriter, *http.Request) bool { panic("boom") })
	_, err := b.tryPost(context.Background(), "/payments", "p", `{"amount": 1}`)
	require.Error(t, err, "net/http drops the connection of a panicking handler")
	require.Equal(t, 0, b.payments(t))
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM inbox`))
	require.Equal(t, float64(1), counter(t, b.reg, "idem_http_requests_total", "POST /payments", "panic"))
	b.setHook(nil)
	require.Equal(t, http.StatusCreated, b.post(t, "/payments", "p", `{"amount": 1}`).Status)
	require.Equal(t, 1, b.payments(t))
}

// TestHandlerEndsTransaction: a handler that ends idem's transaction with raw SQL
// gets its key settled with the stored 500 handler_ended_transaction; one that
// leaves it broken by a failed statement gets a coded 500 and nothing is stored.
func TestHandlerEndsTransaction(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for key, code := range map[string]string{"ROLLBACK": httpidem.CodeHandlerEndedTransaction, "SELECT 1/0": httpidem.CodeTransactionEnded} {
		b.setHook(func(w http.ResponseWriter, r *http.Request) bool {
			_, _ = httpidem.Tx(r.Context()).Exec(r.Context(), key)
			return false
		})
		a := b.post(t, "/payments", key, `{"amount": 1}`)
		problem(t, a, http.StatusInternalServerError, code)
	}
	require.Equal(t, 0, b.payments(t))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM inbox WHERE key = 'ROLLBACK' AND error_code = 'handler_ended_transaction'`))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM inbox`))
	b.setHook(func(w http.ResponseWriter, r *http.Request) bool {
		require.ErrorIs(t, httpidem.Tx(r.Context()).Commit(r.Context()), httpidem.ErrTxOwned)
		require.ErrorIs(t, httpidem.Tx(r.Context()).Rollback(r.Context()), httpidem.ErrTxOwned)
		return false
	})
	require.Equal(t, http.StatusCreated, b.post(t, "/payments", "ok", `{"amount": 1}`).Status)
}

// TestKeyHeader: a missing key is 400 where it is required; invalid keys are 400;
// a quoted key (the draft's sf-string) is the same key as the bare one; a route
// with an optional key runs without one, in a transaction, storing nothing.
func TestKeyHeader(t *testing.T) {
	t.Parallel()
	b := setup(t)
	problem(t, b.post(t, "/payments", "", `{"amount": 1}`), http.StatusBadRequest, httpidem.CodeKeyMissing)
	for _, bad := range []string{`"unterminated`, `"a"b`, `"\x"`, `""`, strings.Repeat("k", inbox.MaxKeyLen+1), "\xff"} {
		problem(t, b.post(t, "/payments", "", `{"amount": 1}`, "Idempotency-Key", bad), http.StatusBadRequest, httpidem.CodeKeyInvalid)
	}
	require.EqualValues(t, 0, b.calls.Load())

	first := b.post(t, "/payments", `"8e03978e-40d5-43e8-bc93-6894a57f9324"`, `{"amount": 1}`)
	require.Equal(t, http.StatusCreated, first.Status)
	requireSameAnswer(t, first, b.post(t, "/payments", `8e03978e-40d5-43e8-bc93-6894a57f9324`, `{"amount": 1}`))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM inbox WHERE key = '8e03978e-40d5-43e8-bc93-6894a57f9324'`))

	// Two key headers are ambiguous.
	req, _ := http.NewRequest(http.MethodPost, b.srv.URL+"/payments", strings.NewReader(`{"amount": 1}`))
	req.Header.Add("Idempotency-Key", "a")
	req.Header.Add("Idempotency-Key", "b")
	resp, err := b.client.Do(req)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	require.Equal(t, http.StatusBadRequest, resp.StatusCode)

	// Optional key: runs every time, commits, stores nothing.
	for range 2 {
		require.Equal(t, http.StatusCreated, b.post(t, "/search", "", `{"amount": 1}`).Status)
	}
	require.Equal(t, 3, b.payments(t))
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM inbox WHERE consumer = 'search'`))
	// With a key it is idempotent like any route.
	first = b.post(t, "/search", "s", `{"amount": 1}`)
	requireSameAnswer(t, first, b.post(t, "/search", "s", `{"amount": 1}`))
	require.Equal(t, 4, b.payments(t))
}

// TestBodyNotJSON: a body that says it is JSON and is not (or repeats a member
// name) is refused before anything runs; other media types count byte for byte.
func TestBodyNotJSON(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, body := range []string{`{"amount": 1`, `{"amount": 1, "amount": 2}`} {
		problem(t, b.post(t, "/payments", "k", body), http.StatusBadRequest, httpidem.CodeBodyNotJSON)
	}
	require.EqualValues(t, 0, b.calls.Load())
	a := b.post(t, "/payments", "k", `amount=1`, "Content-Type", "application/x-www-form-urlencoded")
	require.Equal(t, http.StatusBadRequest, a.Status, "the handler's own 400")
	requireSameAnswer(t, a, b.post(t, "/payments", "k", `amount=1`, "Content-Type", "application/x-www-form-urlencoded"))
	problem(t, b.post(t, "/payments", "k", `amount=2`, "Content-Type", "application/x-www-form-urlencoded"),
		http.StatusUnprocessableEntity, httpidem.CodeFingerprintMismatch)
	// A form counts by its fields, in any order.
	form := "application/x-www-form-urlencoded"
	a = b.post(t, "/payments", "f", `a=1&b=2`, "Content-Type", form)
	requireSameAnswer(t, a, b.post(t, "/payments", "f", `b=2&a=1`, "Content-Type", form))
	// JSON counts as JSON whatever the Content-Type says: curl -d sends it as a form.
	a = b.post(t, "/payments", "j", `{"amount": 1, "email": "e"}`, "Content-Type", form)
	require.Equal(t, http.StatusCreated, a.Status)
	requireSameAnswer(t, a, b.post(t, "/payments", "j", `{"email":"e","amount":1.0}`, "Content-Type", "text/plain"))
	// Other media types count byte for byte.
	b.post(t, "/payments", "x", `<p amount="1"/>`, "Content-Type", "application/xml")
	problem(t, b.post(t, "/payments", "x", `<p  amount="1"/>`, "Content-Type", "application/xml"),
		http.StatusUnprocessableEntity, httpidem.CodeFingerprintMismatch)
}

// TestFingerprintIgnoresHeaders: Authorization, cookies, trace IDs and the key are
// never part of the default fingerprint; a custom one never sees them either.
func TestFingerprintIgnoresHeaders(t *testing.T) {
	t.Parallel()
	var seen []http.Header
	var mu sync.Mutex
	b := setup(t, func(c *httpidem.Config) {
		def := httpidem.DefaultFingerprint(inbox.JSONOptions{Exclude: []string{"email"}})
		c.Fingerprint = func(r *http.Request, body []byte) ([]byte, error) {
			mu.Lock()
			seen = append(seen, r.Header.Clone())
			mu.Unlock()
			return def(r, body)
		}
	})
	first := b.post(t, "/payments", "k", `{"amount": 1, "email": "a@x"}`, "Authorization", "Bearer one", "Traceparent", "00-1-2-01", "Cookie", "s=1")
	replay := b.post(t, "/payments", "k", `{"amount": 1, "email": "b@x"}`, "Authorization", "Bearer two", "Traceparent", "00-3-4-01")
	requireSameAnswer(t, first, replay)
	for _, h := range seen {
		require.Empty(t, h.Get("Authorization"))
		require.Empty(t, h.Get("Cookie"))
		require.Empty(t, h.Get("Idempotency-Key"))
	}
	// The default never reads headers at all.
	fp := httpidem.DefaultFingerprint(inbox.JSONOptions{})
	r1, _ := http.NewRequest(http.MethodPost, "/p?b=2&a=1", strings.NewReader(""))
	r2, _ := http.NewRequest(http.MethodPost, "/p?a=1&b=2", strings.NewReader(""))
	r2.Header.Set("Authorization", "x")
	f1, err := fp(r1, []byte(`{"a":1}`))
	require.NoError(t, err)
	f2, err := fp(r2, []byte(`{ "a" : 1.0 }`))
	require.NoError(t, err)
	require.Equal(t, f1, f2)
	r3, _ := http.NewRequest(http.MethodPut, "/p?a=1&b=2", nil)
	f3, _ := fp(r3, []byte(`{"a":1}`))
	require.NotEqual(t, f1, f3, "the method counts")
}

// TestBodyReference: with a BodyReferencer the body is not stored; a replay
// resolves the reference.
func TestBodyReference(t *testing.T) {
	t.Parallel()
	var b *bundle
	b = setup(t, func(c *httpidem.Config) { c.BodyReference = paymentRef{get: func() *bundle { return b }} })
	first := b.post(t, "/payments", "k", `{"amount": 7}`)
	require.Equal(t, http.StatusCreated, first.Status)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM inbox WHERE response_body IS NULL AND response_ref = 'payment:1'`))
	requireSameAnswer(t, first, b.post(t, "/payments", "k", `{"amount": 7}`))

	_, err := b.pool.Exec(context.Background(), `DELETE FROM payments`)
	require.NoError(t, err)
	problem(t, b.post(t, "/payments", "k", `{"amount": 7}`), http.StatusInternalServerError, httpidem.CodeReplayFailed)
}

// paymentRef stores "payment:<id>" and renders the payment again on a replay.
type paymentRef struct{ get func() *bundle }

func (p paymentRef) Reference(ctx context.Context, r *http.Request, resp *httpidem.Response) (string, error) {
	var id int64
	if _, err := fmt.Sscanf(resp.Header.Get("Location"), "/payments/%d", &id); err != nil {
		return "", err
	}
	return fmt.Sprintf("payment:%d", id), nil
}

func (p paymentRef) Body(ctx context.Context, ref string) ([]byte, error) {
	var id int64
	var amount string
	err := p.get().pool.QueryRow(ctx, `SELECT id, amount::text FROM payments WHERE 'payment:' || id = $1`, ref).Scan(&id, &amount)
	if err != nil {
		return nil, err
	}
	return fmt.Appendf(nil, "{\"id\":%d,\"amount\":%q}\n", id, amount), nil
}

// TestOperationFunc: without a ServeMux pattern (another router, or the middleware
// around the whole mux) the operation comes from Config.Operation; without one the
// request is refused with a coded 500, never run under a guessed name.
func TestOperationFunc(t *testing.T) {
	t.Parallel()
	b := setup(t)
	srv := newServer(t, b.mw.Middleware(http.HandlerFunc(b.handler)))
	a, err := postTo(context.Background(), srv.Client(), srv.URL, "/payments", "k", `{"amount": 1}`)
	require.NoError(t, err)
	problem(t, a, http.StatusInternalServerError, httpidem.CodeNoOperation)
	require.EqualValues(t, 0, b.calls.Load())

	cfg := baseConfig(b.pool, b.schema)
	cfg.Operation = func(r *http.Request) (string, error) { return "create-payment", nil }
	mw, err := httpidem.New(cfg)
	require.NoError(t, err)
	srv = newServer(t, mw.Middleware(http.HandlerFunc(b.handler)))
	first, err := postTo(context.Background(), srv.Client(), srv.URL, "/payments", "k", `{"amount": 1}`)
	require.NoError(t, err)
	require.Equal(t, http.StatusCreated, first.Status)
	replay, err := postTo(context.Background(), srv.Client(), srv.URL, "/payments", "k", `{"amount": 1}`)
	require.NoError(t, err)
	requireSameAnswer(t, first, replay)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM inbox WHERE consumer = 'create-payment'`))

	require.Panics(t, func() { b.mw.Route(httpidem.Route{Operation: "bad\x00name"}) })
}

// TestConfigValidate: bad settings fail New with a reason.
func TestConfigValidate(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for name, mutate := range map[string]func(*httpidem.Config){
		"no pool":        func(c *httpidem.Config) { c.Pool = nil },
		"schema":         func(c *httpidem.Config) { c.Schema = "Bad-Schema" },
		"key header":     func(c *httpidem.Config) { c.KeyHeader = "Authorization" },
		"retention":      func(c *httpidem.Config) { c.Retention = time.Second },
		"response limit": func(c *httpidem.Config) { c.MaxResponseBody = httpidem.MaxStoredBody + 1 },
		"stored header":  func(c *httpidem.Config) { c.StoredHeaders = []string{"content-length"} },
	} {
		cfg := baseConfig(b.pool, b.schema)
		mutate(&cfg)
		_, err := httpidem.New(cfg)
		require.ErrorContains(t, err, "invalid config", name)
	}
}

// TestMissingSchema: without the tables the answer is 503 with Retry-After,
// nothing runs, and the log says to migrate.
func TestMissingSchema(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cfg := baseConfig(b.pool, "idem_nothing_here")
	cfg.SkipSchemaCheck = true // New's check would refuse the schema (TestNewChecksTheSchema)
	mw, err := httpidem.New(cfg)
	require.NoError(t, err)
	srv := newServer(t, routes(mw, b.handler))
	a, err := postTo(context.Background(), srv.Client(), srv.URL, "/payments", "k", `{"amount": 1}`)
	require.NoError(t, err)
	problem(t, a, http.StatusServiceUnavailable, httpidem.CodeDatabaseUnavailable)
	require.Equal(t, "1", a.Header.Get("Retry-After"))
	require.EqualValues(t, 0, b.calls.Load())
}

func newServer(t *testing.T, h http.Handler) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	t.Cleanup(srv.Client().CloseIdleConnections)
	return srv
}

// TestMetricsFromStart: a route with a named operation has every series at 0
// before its first request; a route named by its pattern gets them all at its
// first request.
func TestMetricsFromStart(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, outcome := range []string{"committed", "failed", "replayed", "mismatch", "in_progress", "not_final", "panic",
		"disconnected", "timeout", "rejected", "error", "unkeyed", "recovered"} {
		require.Zero(t, counter(t, b.reg, "idem_http_requests_total", "search", outcome), outcome)
	}
	for _, d := range []string{"rerun", "recovered", "error"} {
		require.Zero(t, counter(t, b.reg, "idem_http_stale_leases_total", "search", d))
	}
	require.Zero(t, counter(t, b.reg, "idem_http_expired_keys_total", "search", ""))

	problem(t, b.post(t, "/payments", "", `{}`), http.StatusBadRequest, httpidem.CodeKeyMissing)
	require.Equal(t, float64(1), counter(t, b.reg, "idem_http_requests_total", "POST /payments", "rejected"))
	require.Zero(t, counter(t, b.reg, "idem_http_requests_total", "POST /payments", "committed"))
	require.Zero(t, counter(t, b.reg, "idem_http_expired_keys_total", "POST /payments", ""))
}

// TestBinaryAnswer: a body with NUL and invalid UTF-8, and a stored header that is
// not UTF-8, come back byte for byte.
func TestBinaryAnswer(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *httpidem.Config) { c.StoredHeaders = append(c.StoredHeaders, "X-Bin") })
	b.setHook(func(w http.ResponseWriter, r *http.Request) bool {
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Header().Set("X-Bin", "\xff\xfe é")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte("\x00\xff\xfe{\"a\":1}\r\n\x00"))
		return true
	})
	first := b.post(t, "/payments", "bin", `{"amount": 1}`)
	require.Equal(t, []byte("\x00\xff\xfe{\"a\":1}\r\n\x00"), first.Body)
	replay := b.post(t, "/payments", "bin", `{"amount": 1}`)
	requireSameAnswer(t, first, replay)
	require.Equal(t, "\xff\xfe é", replay.Header.Get("X-Bin"))
}

// TestHandlerTxIsAPgxTx: the transaction a handler gets behaves as pgx's does:
// nested Begin makes savepoints, batches and COPY run in it, and large objects
// work; everything commits with the answer.
func TestHandlerTxIsAPgxTx(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.setHook(func(w http.ResponseWriter, r *http.Request) bool {
		ctx := r.Context()
		tx := httpidem.Tx(ctx)
		fail := func(err error) bool {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return true
		}
		inner, err := tx.Begin(ctx)
		if err != nil {
			return fail(err)
		}
		if _, err := inner.Exec(ctx, `INSERT INTO audit (note) VALUES ('rolled back')`); err != nil {
			return fail(err)
		}
		if err := inner.Rollback(ctx); err != nil {
			return fail(err)
		}
		inner, err = tx.Begin(ctx)
		if err != nil {
			return fail(err)
		}
		deeper, err := inner.Begin(ctx)
		if err != nil {
			return fail(err)
		}
		if _, err := deeper.Exec(ctx, `INSERT INTO audit (note) VALUES ('kept')`); err != nil {
			return fail(err)
		}
		if err := deeper.Commit(ctx); err != nil {
			return fail(err)
		}
		if err := inner.Commit(ctx); err != nil {
			return fail(err)
		}
		if _, err := tx.CopyFrom(ctx, pgx.Identifier{"audit"}, []string{"note"}, pgx.CopyFromRows([][]any{{"copied"}})); err != nil {
			return fail(err)
		}
		batch := &pgx.Batch{}
		batch.Queue(`INSERT INTO audit (note) VALUES ('batched')`)
		if err := tx.SendBatch(ctx, batch).Close(); err != nil {
			return fail(err)
		}
		lo := tx.LargeObjects()
		oid, err := lo.Create(ctx, 0)
		if err != nil {
			return fail(err)
		}
		if err := lo.Unlink(ctx, oid); err != nil { // large objects outlive the test's schema
			return fail(err)
		}
		return false
	})
	a := b.post(t, "/payments", "k", `{"amount": 1}`)
	require.Equal(t, http.StatusCreated, a.Status, "%s", a)
	require.Equal(t, 1, b.payments(t))
	require.Equal(t, 3, b.count(t, `SELECT count(*) FROM audit`))
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM audit WHERE note = 'rolled back'`))
	requireSameAnswer(t, a, b.post(t, "/payments", "k", `{"amount": 1}`))
}

// TestDefaultFingerprintIsStable: the default fingerprint of a request never
// changes between versions, or every stored key would answer its retries 422.
// The values were computed by the first release's code.
func TestDefaultFingerprintIsStable(t *testing.T) {
	t.Parallel()
	fp := httpidem.DefaultFingerprint(inbox.JSONOptions{})
	for _, c := range []struct{ contentType, body, want string }{
		{"application/json", `{"b": 1.50, "a": [true, null]}`, "02015885726e824779095f98b36747ec8792196fb530684a7db90597443a3396"},
		// Its canonical form, which is hashed as it comes (inbox.IsCanonical).
		{"application/json", `{"a":[true,null],"b":1.5}`, "02015885726e824779095f98b36747ec8792196fb530684a7db90597443a3396"},
		{"application/x-www-form-urlencoded", "b=2&a=1", "17978c783c846c5fe7dfb81e3f0c616b2de8d4b3183bd8f55e16f0f509ce4e79"},
		{"application/xml", "<x/>", "d4ab387f75394c4afd520b83113e7da488da89fa9a4418a7243ed28690751d17"},
		{"", "", "5078562686025fe7cbf01f56152fac6f13de15d76b3d31b2a260426a2a91d5ef"},
	} {
		r, err := http.NewRequest(http.MethodPost, "/accounts/7/payments?z=1&y=%20", strings.NewReader(c.body))
		require.NoError(t, err)
		if c.contentType != "" {
			r.Header.Set("Content-Type", c.contentType)
		}
		got, err := fp(r, []byte(c.body))
		require.NoError(t, err)
		require.Equal(t, c.want, hex.EncodeToString(got), c.contentType)
	}
}
