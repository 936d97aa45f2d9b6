package httpidem_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/httpidem"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/pgtest"
)

// setupPooled is setup with the middleware on a pool of its own with maxConns
// connections (b.mwPool); b.pool, for the test's own queries, is another. The
// server and the middleware's pool are closed within a bound when the test ends:
// a request stuck on a connection fails the test instead of hanging it.
func setupPooled(t *testing.T, maxConns int32, mutate ...func(*httpidem.Config)) *bundle {
	t.Helper()
	pool, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 4})
	_, err := pool.Exec(context.Background(), paymentsDDL)
	require.NoError(t, err)
	small, err := pgxpool.NewWithConfig(context.Background(), pgtest.PoolConfig(t, schema, pgtest.Options{MaxConns: maxConns}))
	require.NoError(t, err)
	t.Cleanup(func() { closeWithin(t, "the middleware's pool", small.Close) })
	b := &bundle{pool: pool, mwPool: small, schema: schema}
	cfg := baseConfig(small, schema)
	for _, m := range mutate {
		m(&cfg)
	}
	b.mw, err = httpidem.New(cfg)
	require.NoError(t, err)
	b.srv = httptest.NewServer(routes(b.mw, b.handler))
	t.Cleanup(func() { closeWithin(t, "the server", b.srv.Close) })
	// A new connection per request: net/http's client retries a request that
	// carries an Idempotency-Key once on a reused connection that dropped, which
	// would turn a panic's dropped connection into a second request.
	b.client = &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 60 * time.Second}
	return b
}

// closeWithin runs close and fails the test if it has not returned in 20 s (a
// request still holds a connection, or is still running).
func closeWithin(t *testing.T, what string, fn func()) {
	done := make(chan struct{})
	go func() { fn(); close(done) }()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Errorf("%s did not close within 20 s: a request still runs or holds a connection", what)
	}
}

// barrier lets n goroutines through together: each waits until n have arrived
// (or 10 s have passed, so that a test never hangs on it).
type barrier struct {
	n       int
	mu      sync.Mutex
	waiting int
	gate    chan struct{}
}

func (b *barrier) wait() {
	b.mu.Lock()
	if b.gate == nil {
		b.gate = make(chan struct{})
	}
	gate := b.gate
	b.waiting++
	if b.waiting == b.n {
		close(b.gate)
		b.gate, b.waiting = nil, 0
	}
	b.mu.Unlock()
	select {
	case <-gate:
	case <-time.After(10 * time.Second):
	}
}

// TestOneConnectionPerRequest: a request holds at most one pool connection at a
// time, on every path, in both modes (a handler's raw COMMIT or ROLLBACK included:
// the key is settled on the request's connection). The middleware's pool has n
// connections and 2n requests run at once on each path; each request's handler (or
// Recover) waits until n of them hold a connection, so that all n go on to what
// follows the handler together: a request that needed a second connection there
// would wait for one of the others, which wait for it. Every request must be
// answered within the deadline, with the rows its path leaves.
func TestOneConnectionPerRequest(t *testing.T) {
	t.Parallel()
	const n = 2
	gate := &barrier{n: n}
	b := setupPooled(t, n, func(c *httpidem.Config) {
		c.Lease.Duration = time.Minute // stale leases are made by hand
		c.Lease.Recover = func(ctx context.Context, s httpidem.Stale) (*httpidem.Response, error) {
			mode := strings.TrimPrefix(s.Tenant, "lease-")
			if mode == "stale" {
				return nil, nil // run the handler again
			}
			gate.wait()
			tx := httpidem.Tx(ctx)
			if _, err := tx.Exec(ctx, `INSERT INTO payments (tenant, amount) VALUES ($1, 1)`, s.Tenant); err != nil {
				return nil, err
			}
			switch mode {
			case "recover":
				return &httpidem.Response{Status: http.StatusCreated, Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(`{"recovered":true}`)}, nil
			case "recover-422":
				return &httpidem.Response{Status: http.StatusUnprocessableEntity, Body: []byte("provider refused it")}, nil
			default:
				return nil, errors.New("provider unreachable")
			}
		}
	})
	b.setHook(func(w http.ResponseWriter, r *http.Request) bool {
		_, mode, _ := strings.Cut(r.Header.Get("X-Tenant"), "-")
		gate.wait()
		switch mode {
		case "422":
			w.WriteHeader(http.StatusUnprocessableEntity)
			_, _ = w.Write([]byte("refused"))
			return true
		case "503":
			w.WriteHeader(http.StatusServiceUnavailable)
			return true
		case "panic":
			panic(http.ErrAbortHandler)
		case "commit":
			_, _ = httpidem.Tx(r.Context()).Exec(r.Context(), "COMMIT")
		case "rollback":
			// The payment so far is rolled back; this one commits at once, outside any
			// transaction, and the key is settled on the request's connection.
			tx := httpidem.Tx(r.Context())
			_, _ = tx.Exec(r.Context(), "ROLLBACK")
			_, _ = tx.Exec(r.Context(), `INSERT INTO payments (tenant, amount) VALUES ($1, 1)`, r.Header.Get("X-Tenant"))
		}
		return false
	})
	store, err := inboxdb.NewStore(b.schema)
	require.NoError(t, err)

	// rows counts the tenant's inbox rows that match cond.
	rows := func(tenant, cond string) int {
		return b.count(t, `SELECT count(*) FROM inbox WHERE tenant = $1 AND `+cond, tenant)
	}
	paid := func(tenant string) int { return b.count(t, `SELECT count(*) FROM payments WHERE tenant = $1`, tenant) }
	const body = `{"amount": 1}`
	for _, c := range []struct {
		tenant string // the mode's route and the path's hook
		stale  bool   // the keys' leases ran out before the requests
		status int    // 0: the connection is dropped (a panic)
		check  func(tenant string)
	}{
		{"tx-ok", false, http.StatusCreated, func(tn string) {
			require.Equal(t, 2*n, rows(tn, `state = 'completed' AND response_status = 201`))
			require.Equal(t, 2*n, paid(tn))
		}},
		{"tx-422", false, http.StatusUnprocessableEntity, func(tn string) {
			require.Equal(t, 2*n, rows(tn, `state = 'failed' AND response_status = 422 AND response_body = 'refused'`))
			require.Zero(t, paid(tn), "rolled back")
		}},
		{"tx-503", false, http.StatusServiceUnavailable, func(tn string) {
			require.Zero(t, rows(tn, `true`))
			require.Zero(t, paid(tn))
		}},
		{"tx-panic", false, 0, func(tn string) {
			require.Zero(t, rows(tn, `true`))
			require.Zero(t, paid(tn))
		}},
		{"tx-commit", false, http.StatusInternalServerError, func(tn string) {
			require.Equal(t, 2*n, rows(tn, `state = 'completed' AND response_status = 500 AND error_code = 'handler_committed'`))
			require.Equal(t, 2*n, paid(tn), "the handler committed its work itself")
		}},
		{"tx-rollback", false, http.StatusInternalServerError, func(tn string) {
			require.Equal(t, 2*n, rows(tn, `state = 'failed' AND response_status = 500 AND error_code = 'handler_ended_transaction'`))
			require.Equal(t, 2*n, paid(tn), "written after the handler's ROLLBACK, once each")
		}},
		{"lease-ok", false, http.StatusCreated, func(tn string) {
			require.Equal(t, 2*n, rows(tn, `state = 'completed' AND response_status = 201 AND fence = 1`))
			require.Equal(t, 2*n, paid(tn))
		}},
		{"lease-422", false, http.StatusUnprocessableEntity, func(tn string) {
			require.Equal(t, 2*n, rows(tn, `state = 'failed' AND response_status = 422`))
			require.Zero(t, paid(tn))
		}},
		{"lease-503", false, http.StatusServiceUnavailable, func(tn string) {
			require.Equal(t, 2*n, rows(tn, `state = 'processing' AND lease_until <= now()`), "the leases were given back")
			require.Zero(t, paid(tn))
		}},
		{"lease-panic", false, 0, func(tn string) {
			require.Equal(t, 2*n, rows(tn, `state = 'processing' AND lease_until <= now()`), "the leases were given back")
			require.Zero(t, paid(tn))
		}},
		{"lease-commit", false, http.StatusInternalServerError, func(tn string) {
			require.Equal(t, 2*n, rows(tn, `state = 'completed' AND response_status = 500 AND error_code = 'handler_committed'`))
			require.Equal(t, 2*n, paid(tn))
		}},
		{"lease-rollback", false, http.StatusInternalServerError, func(tn string) {
			require.Equal(t, 2*n, rows(tn, `state = 'failed' AND response_status = 500 AND error_code = 'handler_ended_transaction' AND lease_until IS NULL`))
			require.Equal(t, 2*n, paid(tn), "written after the handler's ROLLBACK, once each")
		}},
		{"lease-stale", true, http.StatusCreated, func(tn string) {
			require.Equal(t, 2*n, rows(tn, `state = 'completed' AND response_status = 201 AND fence = 2`))
			require.Equal(t, 2*n, paid(tn))
		}},
		{"lease-recover", true, http.StatusCreated, func(tn string) {
			require.Equal(t, 2*n, rows(tn, `state = 'completed' AND response_status = 201 AND fence = 2 AND response_body = '{"recovered":true}'`))
			require.Equal(t, 2*n, paid(tn), "Recover's rows, committed with the answer")
		}},
		{"lease-recover-422", true, http.StatusUnprocessableEntity, func(tn string) {
			require.Equal(t, 2*n, rows(tn, `state = 'failed' AND response_status = 422 AND fence = 2`))
			require.Zero(t, paid(tn), "Recover's rows rolled back")
		}},
		{"lease-recover-error", true, http.StatusServiceUnavailable, func(tn string) {
			require.Equal(t, 2*n, rows(tn, `state = 'processing' AND lease_until <= now() AND fence = 2`), "the leases were given back")
			require.Zero(t, paid(tn), "Recover's rows rolled back")
		}},
	} {
		path := "/payments"
		if strings.HasPrefix(c.tenant, "lease-") {
			path = "/leased/payments"
		}
		if c.stale {
			for i := range 2 * n {
				staleKey(t, b, store, c.tenant, fmt.Sprintf("k%d", i), body)
			}
		}
		calls := b.calls.Load()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		answers, errs := make([]answer, 2*n), make([]error, 2*n)
		var wg sync.WaitGroup
		for i := range 2 * n {
			wg.Go(func() {
				answers[i], errs[i] = b.tryPost(ctx, path, fmt.Sprintf("k%d", i), body, "X-Tenant", c.tenant)
			})
		}
		wg.Wait()
		cancel()
		for i := range 2 * n {
			if errors.Is(errs[i], context.DeadlineExceeded) {
				t.Fatalf("%s: request %d of %d was not answered within 30 s on a pool of %d: a request waited for a second connection while it held one",
					c.tenant, i, 2*n, n)
			}
			if c.status == 0 {
				require.Error(t, errs[i], "%s: net/http drops the connection of a panicking handler; got %s", c.tenant, answers[i])
				continue
			}
			require.NoError(t, errs[i], c.tenant)
			require.Equal(t, c.status, answers[i].Status, "%s: %s", c.tenant, answers[i])
		}
		c.check(c.tenant)
		if strings.HasPrefix(c.tenant, "lease-recover") {
			require.Equal(t, calls, b.calls.Load(), "%s: Recover settled the keys; the handler never ran", c.tenant)
		}
		pgtest.WaitFor(t, 10*time.Second, c.tenant+": every connection back in the pool", func() bool { return b.mwPool.Stat().AcquiredConns() == 0 })
	}
}

// staleKey leaves what a server killed in a lease-mode handler leaves: a
// processing row past its lease, with the fingerprint of the request it ran.
func staleKey(t *testing.T, b *bundle, store *inboxdb.Store, tenant, key, body string) {
	t.Helper()
	ctx := context.Background()
	r, _ := http.NewRequest(http.MethodPost, "/leased/payments", nil)
	r.Header.Set("Content-Type", "application/json")
	fp, err := httpidem.DefaultFingerprint(inbox.JSONOptions{})(r, []byte(body))
	require.NoError(t, err)
	res, err := store.Lease(ctx, b.pool, inboxdb.Claim{ID: inboxdb.ID{Consumer: "POST /leased/payments", Tenant: tenant, Key: key}, Fingerprint: fp}, time.Minute)
	require.NoError(t, err)
	require.True(t, res.Claimed)
	_, err = b.pool.Exec(ctx, `UPDATE inbox SET lease_until = now() - interval '1 millisecond' WHERE tenant = $1 AND key = $2`, tenant, key)
	require.NoError(t, err)
}

// TestSlowReadersHoldNoConnection: a request gives its connection back before it
// writes its answer. Four clients post on a pool of four connections, each for a
// 4 MiB answer, and never read it: their answers are committed and stuck in the
// socket, and a request on another route is still served.
func TestSlowReadersHoldNoConnection(t *testing.T) {
	t.Parallel()
	for _, path := range []string{"/payments", "/leased/payments"} {
		t.Run(strings.TrimPrefix(path, "/"), func(t *testing.T) {
			t.Parallel()
			const n, size = 4, 4 << 20
			b := setupPooled(t, n, func(c *httpidem.Config) { c.MaxResponseBody = 2 * size })
			big := bytes.Repeat([]byte("x"), size)
			b.setHook(func(w http.ResponseWriter, r *http.Request) bool {
				if r.Header.Get("X-Big") == "" {
					return false
				}
				w.WriteHeader(http.StatusCreated)
				_, _ = w.Write(big)
				return true
			})
			addr := b.srv.Listener.Addr().String()
			for i := range n {
				// A client that sends its request and reads nothing, with a small
				// receive buffer, so that the answer cannot fit in the sockets.
				d := net.Dialer{Control: func(_, _ string, c syscall.RawConn) error {
					var serr error
					err := c.Control(func(fd uintptr) { serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096) })
					return errors.Join(err, serr)
				}}
				conn, err := d.Dial("tcp", addr)
				require.NoError(t, err)
				t.Cleanup(func() { _ = conn.Close() })
				req := `{"amount": 1}`
				_, err = fmt.Fprintf(conn, "POST %s HTTP/1.1\r\nHost: %s\r\nIdempotency-Key: big-%d\r\nX-Tenant: t0\r\nX-Big: 1\r\n"+
					"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", path, addr, i, len(req), req)
				require.NoError(t, err)
			}
			pgtest.WaitFor(t, 30*time.Second, "the four big answers to commit", func() bool {
				return b.count(t, `SELECT count(*) FROM inbox WHERE key LIKE 'big-%' AND state = 'completed' AND response_status = 201`) == n
			})
			pgtest.WaitFor(t, 10*time.Second, "the connections of the committed requests to go back to the pool while their clients do not read", func() bool {
				return b.mwPool.Stat().AcquiredConns() == 0
			})
			ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
			defer cancel()
			a, err := b.tryPost(ctx, "/accounts/7/payments", "other", `{"amount": 2}`)
			require.NoError(t, err, "a request on another route is served")
			require.Equal(t, http.StatusCreated, a.Status, "%s", a)
			require.Equal(t, n+1, b.payments(t))
		})
	}
}
