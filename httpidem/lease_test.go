package httpidem_test

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/httpidem"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/inboxdb"
)

// TestLeaseMode: the key commits as processing before the handler runs; a
// concurrent request waits up to LockTimeout and then replays or answers 409; a different
// body is 422; a final answer is stored with the fence and replayed.
func TestLeaseMode(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *httpidem.Config) { c.LockTimeout = 100 * time.Millisecond })
	entered, release := make(chan struct{}), make(chan struct{})
	b.setHook(func(w http.ResponseWriter, r *http.Request) bool {
		if id, ok := httpidem.KeyFrom(r.Context()); ok && id.Key == "slow" {
			close(entered)
			<-release
		}
		return false
	})
	done := make(chan answer)
	go func() { done <- b.post(t, "/leased/payments", "slow", `{"amount": 1}`) }()
	<-entered
	// The lease is committed while the handler runs: visible to everyone.
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM inbox WHERE state = 'processing' AND fence = 1 AND lease_until > now()`))
	a := b.post(t, "/leased/payments", "slow", `{"amount": 1}`)
	problem(t, a, http.StatusConflict, httpidem.CodeInProgress)
	require.Equal(t, "1", a.Header.Get("Retry-After"))
	problem(t, b.post(t, "/leased/payments", "slow", `{"amount": 2}`), http.StatusUnprocessableEntity, httpidem.CodeFingerprintMismatch)
	close(release)
	first := <-done
	require.Equal(t, http.StatusCreated, first.Status)
	requireSameAnswer(t, first, b.post(t, "/leased/payments", "slow", `{"amount": 1}`))
	require.Equal(t, 1, b.payments(t))
	require.EqualValues(t, 1, b.calls.Load())
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM inbox WHERE state = 'completed' AND lease_until IS NULL AND response_status = 201`))

	// A 500 gives the key back at once: the retry runs again without waiting out
	// the lease, and a 422 is stored as failed.
	fail := true
	b.setHook(func(w http.ResponseWriter, r *http.Request) bool {
		if fail {
			fail = false
			w.WriteHeader(http.StatusBadGateway)
			return true
		}
		return false
	})
	require.Equal(t, http.StatusBadGateway, b.post(t, "/leased/payments", "flaky", `{"amount": 1}`).Status)
	require.Equal(t, http.StatusCreated, b.post(t, "/leased/payments", "flaky", `{"amount": 1}`).Status)
	bad := b.post(t, "/leased/payments", "neg", `{"amount": -1}`)
	require.Equal(t, http.StatusUnprocessableEntity, bad.Status)
	requireSameAnswer(t, bad, b.post(t, "/leased/payments", "neg", `{"amount": -1}`))
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM audit`))
	require.Equal(t, 2, b.payments(t))
}

// TestLeaseWaitThenReplay: a request that finds a fresh lease and waits gets the
// stored answer as soon as the holder settles within LockTimeout.
func TestLeaseWaitThenReplay(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *httpidem.Config) { c.LockTimeout = 30 * time.Second })
	entered, release := make(chan struct{}), make(chan struct{})
	var once atomic.Bool
	b.setHook(func(w http.ResponseWriter, r *http.Request) bool {
		if once.CompareAndSwap(false, true) {
			close(entered)
			<-release
		}
		return false
	})
	waiting := make(chan struct{})
	httpidem.SetOnLeaseWait(b.mw, func(*http.Request) { close(waiting) })
	done := make(chan answer)
	go func() { done <- b.post(t, "/leased/payments", "k", `{"amount": 1}`) }()
	<-entered
	second := make(chan answer)
	go func() { second <- b.post(t, "/leased/payments", "k", `{"amount": 1}`) }()
	<-waiting // the second request found the lease held and waits
	close(release)
	first := <-done
	requireSameAnswer(t, first, <-second)
	require.Equal(t, 1, b.payments(t))
}

// TestLeaseStaleKey: a holder that outlives its lease (as a crashed server would)
// loses the key to the next request, which takes it over with fence 2 and asks
// Recover. Run again: one payment, and the old holder's late commit is refused by
// the fence. Recovered: the stored answer is Recover's, the handler never runs.
// Recover failing: 503, and the key is free for the next retry.
func TestLeaseStaleKey(t *testing.T) {
	t.Parallel()
	var decide atomic.Value // func(httpidem.Stale) (*httpidem.Response, error)
	var stales []httpidem.Stale
	b := setup(t, func(c *httpidem.Config) {
		c.Lease.Duration = time.Minute // leases are run out by hand below, so no test races the clock
		c.LockTimeout = 50 * time.Millisecond
		c.Lease.Recover = func(ctx context.Context, s httpidem.Stale) (*httpidem.Response, error) {
			stales = append(stales, s)
			return decide.Load().(func(httpidem.Stale) (*httpidem.Response, error))(s)
		}
	})
	decide.Store(func(httpidem.Stale) (*httpidem.Response, error) { return nil, nil })

	// 1. The first attempt hangs past its lease.
	entered, release := make(chan struct{}), make(chan struct{})
	var first atomic.Bool
	b.setHook(func(w http.ResponseWriter, r *http.Request) bool {
		if first.CompareAndSwap(false, true) {
			close(entered)
			<-release
		}
		return false
	})
	late := make(chan answer)
	go func() { late <- b.post(t, "/leased/payments", "k", `{"amount": 9}`) }()
	<-entered
	problem(t, b.post(t, "/leased/payments", "k", `{"amount": 9}`), http.StatusConflict, httpidem.CodeInProgress) // fresh
	runOut := func(key string) {
		_, err := b.pool.Exec(context.Background(), `UPDATE inbox SET lease_until = now() - interval '1 millisecond' WHERE key = $1 AND state = 'processing'`, key)
		require.NoError(t, err)
	}
	runOut("k") // the first attempt outlived its lease
	rerun := b.post(t, "/leased/payments", "k", `{"amount": 9}`)
	require.Equal(t, http.StatusCreated, rerun.Status)
	require.Len(t, stales, 1)
	require.Equal(t, httpidem.Stale{Request: stales[0].Request, Operation: "POST /leased/payments", Tenant: defaultTenant, Key: "k", Fence: 2}, stales[0])
	close(release)
	problem(t, <-late, http.StatusConflict, httpidem.CodeInProgress) // its lease was lost: rolled back
	require.Equal(t, 1, b.payments(t))
	requireSameAnswer(t, rerun, b.post(t, "/leased/payments", "k", `{"amount": 9}`))
	require.Equal(t, float64(1), counter(t, b.reg, "idem_http_stale_leases_total", "POST /leased/payments", "rerun"))

	// 2. A stale key that Recover settles: the handler never runs.
	ctx := context.Background()
	store, err := inboxdb.NewStore(b.schema)
	require.NoError(t, err)
	crashed := func(key, body string) {
		// What a server killed mid-handler leaves: a processing row past its lease,
		// with the fingerprint of the request it was running.
		r, _ := http.NewRequest(http.MethodPost, "/leased/payments", nil)
		r.Header.Set("Content-Type", "application/json")
		fp, err := httpidem.DefaultFingerprint(inbox.JSONOptions{})(r, []byte(body))
		require.NoError(t, err)
		res, err := store.Lease(ctx, b.pool, inboxdb.Claim{ID: inboxdb.ID{Consumer: "POST /leased/payments", Tenant: defaultTenant, Key: key}, Fingerprint: fp}, time.Minute)
		require.NoError(t, err)
		require.True(t, res.Claimed)
		runOut(key)
	}
	crashed("r", `{"amount": 5}`)
	decide.Store(func(s httpidem.Stale) (*httpidem.Response, error) {
		h := http.Header{"Content-Type": {"application/json"}, "Location": {"/payments/provider-77"}}
		return &httpidem.Response{Status: http.StatusCreated, Header: h, Body: []byte(`{"id":"provider-77"}`)}, nil
	})
	calls := b.calls.Load()
	got := b.post(t, "/leased/payments", "r", `{"amount": 5}`)
	require.Equal(t, http.StatusCreated, got.Status)
	require.Equal(t, `{"id":"provider-77"}`, string(got.Body))
	require.Equal(t, calls, b.calls.Load(), "Recover settled it; the handler did not run")
	requireSameAnswer(t, got, b.post(t, "/leased/payments", "r", `{"amount": 5}`))
	require.Equal(t, 1, b.payments(t))

	// 3. Recover fails: 503, nothing stored; the next retry asks again.
	crashed("e", `{"amount": 6}`)
	decide.Store(func(httpidem.Stale) (*httpidem.Response, error) { return nil, errors.New("provider unreachable") })
	a := b.post(t, "/leased/payments", "e", `{"amount": 6}`)
	problem(t, a, http.StatusServiceUnavailable, httpidem.CodeRecoveryFailed)
	require.NotEmpty(t, a.Header.Get("Retry-After"))
	decide.Store(func(httpidem.Stale) (*httpidem.Response, error) { return nil, nil })
	require.Equal(t, http.StatusCreated, b.post(t, "/leased/payments", "e", `{"amount": 6}`).Status)
	require.Equal(t, 2, b.payments(t))
	require.Equal(t, float64(1), counter(t, b.reg, "idem_http_stale_leases_total", "POST /leased/payments", "error"))
	require.Equal(t, float64(1), counter(t, b.reg, "idem_http_stale_leases_total", "POST /leased/payments", "recovered"))
}

// TestRecoverRunsInTheRequestsTransaction: Recover gets the request's transaction
// (Tx), its key (KeyFrom) and the effects scope. What it writes commits with the
// answer it returns; returning nil runs the handler in the same transaction, after
// its writes; an error rolls its writes back and gives the lease back at once.
func TestRecoverRunsInTheRequestsTransaction(t *testing.T) {
	t.Parallel()
	var fail atomic.Bool
	b := setup(t, func(c *httpidem.Config) {
		c.Lease.Duration = time.Minute
		c.Lease.Recover = func(ctx context.Context, s httpidem.Stale) (*httpidem.Response, error) {
			tx := httpidem.Tx(ctx)
			if tx == nil {
				return nil, errors.New("Recover got no transaction")
			}
			id, ok := httpidem.KeyFrom(ctx)
			if !ok || id.Key != s.Key || id.Tenant != s.Tenant {
				return nil, errors.New("Recover got no key")
			}
			if _, err := tx.Exec(ctx, `INSERT INTO audit (note) VALUES ($1)`, "provider state of "+s.Key); err != nil {
				return nil, err
			}
			if _, err := effects.Enqueue(ctx, tx, effects.Effect{Kind: "email", Key: "recovered:" + s.Key, Payload: []byte("x")}); err != nil {
				return nil, err
			}
			switch {
			case fail.Load():
				return nil, errors.New("provider unreachable")
			case s.Key == "refuse":
				// A failed statement it catches, answered with a final 422.
				if _, err := tx.Exec(ctx, `SELECT 1/0`); err == nil {
					return nil, errors.New("1/0 succeeded")
				}
				return &httpidem.Response{Status: http.StatusUnprocessableEntity, Header: http.Header{"Content-Type": {"text/plain"}}, Body: []byte("refused")}, nil
			case s.Key == "settle":
				return &httpidem.Response{Status: http.StatusCreated, Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(`{"id":"p-1"}`)}, nil
			}
			return nil, nil
		}
	})
	store, err := inboxdb.NewStore(b.schema)
	require.NoError(t, err)
	const body = `{"amount": 5}`

	// Settled by Recover: its row and effect commit with the stored answer.
	staleKey(t, b, store, defaultTenant, "settle", body)
	got := b.post(t, "/leased/payments", "settle", body)
	require.Equal(t, http.StatusCreated, got.Status, "%s", got)
	require.EqualValues(t, 0, b.calls.Load())
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM audit WHERE note = 'provider state of settle'`))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM effects WHERE key = 'recovered:settle' AND source_consumer = 'POST /leased/payments'
		AND source_tenant = $1 AND source_key = 'settle'`, defaultTenant))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM inbox WHERE key = 'settle' AND state = 'completed' AND fence = 2 AND response_status = 201`))
	requireSameAnswer(t, got, b.post(t, "/leased/payments", "settle", body))

	// A final 422 past a failed statement: stored as Recover's answer, its writes
	// rolled back with the transaction, and the handler never runs.
	staleKey(t, b, store, defaultTenant, "refuse", body)
	got = b.post(t, "/leased/payments", "refuse", body)
	require.Equal(t, http.StatusUnprocessableEntity, got.Status, "%s", got)
	require.Equal(t, "refused", string(got.Body))
	requireSameAnswer(t, got, b.post(t, "/leased/payments", "refuse", body))
	require.EqualValues(t, 0, b.calls.Load())
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM audit WHERE note = 'provider state of refuse'`))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM inbox WHERE key = 'refuse' AND state = 'failed' AND fence = 2 AND response_status = 422`))

	// Run again: Recover's writes and the handler's commit together.
	staleKey(t, b, store, defaultTenant, "rerun", body)
	require.Equal(t, http.StatusCreated, b.post(t, "/leased/payments", "rerun", body).Status)
	require.EqualValues(t, 1, b.calls.Load())
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM audit WHERE note = 'provider state of rerun'`))
	require.Equal(t, 1, b.payments(t))

	// Recover fails: its writes roll back, and the lease is given back, so the
	// next retry asks again at once.
	staleKey(t, b, store, defaultTenant, "fails", body)
	fail.Store(true)
	problem(t, b.post(t, "/leased/payments", "fails", body), http.StatusServiceUnavailable, httpidem.CodeRecoveryFailed)
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM audit WHERE note = 'provider state of fails'`))
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM effects WHERE key = 'recovered:fails'`))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM inbox WHERE key = 'fails' AND state = 'processing' AND lease_until <= now()`))
	fail.Store(false)
	require.Equal(t, http.StatusCreated, b.post(t, "/leased/payments", "fails", body).Status)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM audit WHERE note = 'provider state of fails'`))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM inbox WHERE key = 'fails' AND state = 'completed' AND fence = 3`))
}

// TestExpiredKeyForgotten: an inbox row past its expires_at that the janitor has
// not deleted yet is forgotten, in both modes, whatever it holds (a success or a
// stored failure): the request runs as new, even with another body (never a
// mismatch, never a replay), the row is replaced, and the expiry is counted.
func TestExpiredKeyForgotten(t *testing.T) {
	t.Parallel()
	for _, path := range []string{"/payments", "/leased/payments"} {
		t.Run(strings.TrimPrefix(path, "/"), func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			op := "POST " + path
			expire := func(key string) {
				_, err := b.pool.Exec(context.Background(), `UPDATE inbox SET expires_at = now() - interval '1 second' WHERE key = $1`, key)
				require.NoError(t, err)
			}
			first := b.post(t, path, "old", `{"amount": 1}`)
			require.Equal(t, http.StatusCreated, first.Status)
			refused := b.post(t, path, "old-422", `{"amount": -1}`)
			require.Equal(t, http.StatusUnprocessableEntity, refused.Status)
			expire("old")
			expire("old-422")

			again := b.post(t, path, "old", `{"amount": 2}`)
			require.Equal(t, http.StatusCreated, again.Status, "%s", again)
			require.False(t, again.Replayed)
			require.Equal(t, "{\"id\":2,\"amount\":\"2\"}\n", string(again.Body))
			ok := b.post(t, path, "old-422", `{"amount": 3}`)
			require.Equal(t, http.StatusCreated, ok.Status, "%s", ok)
			require.False(t, ok.Replayed)

			require.Equal(t, 3, b.payments(t))
			require.Equal(t, 2, b.count(t, `SELECT count(*) FROM inbox`), "each key has one row: the new one")
			require.Equal(t, 2, b.count(t, `SELECT count(*) FROM inbox WHERE key IN ('old', 'old-422') AND state = 'completed'
				AND response_status = 201 AND expires_at > now() + interval '23 hours'`))
			require.Equal(t, float64(2), counter(t, b.reg, "idem_http_expired_keys_total", op, ""))
			requireSameAnswer(t, again, b.post(t, path, "old", `{"amount": 2}`))
			require.Equal(t, float64(2), counter(t, b.reg, "idem_http_expired_keys_total", op, ""), "a live key is not counted")
		})
	}
}
