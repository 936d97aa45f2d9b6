package httpidem_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/httpidem"
	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/pgtest"
)

// TestMain runs the child server of the crash test in a child process, and
// otherwise the tests, checking for leaked goroutines.
func TestMain(m *testing.M) {
	childproc.Main(childRoles)
	goleak.VerifyTestMain(m)
}

// bundle is one test's world: a schema with a payments table, a middleware, a
// real HTTP server and a client.
type bundle struct {
	pool *pgxpool.Pool
	// mwPool is the middleware's pool when it is not pool (setupPooled).
	mwPool *pgxpool.Pool
	schema string
	reg    *prometheus.Registry
	mw     *httpidem.Middleware
	srv    *httptest.Server
	client *http.Client
	// calls counts handler runs.
	calls atomic.Int64
	// hook, if set, runs in the handler after the payment row and its effect are
	// written and before the answer; it may answer itself (return true).
	hook atomic.Pointer[func(w http.ResponseWriter, r *http.Request) bool]
}

const paymentsDDL = `CREATE TABLE payments (id bigserial PRIMARY KEY, tenant text NOT NULL, amount numeric NOT NULL);
	CREATE TABLE audit (id bigserial PRIMARY KEY, note text NOT NULL)`

// setup starts a server with POST /payments (transactional), POST
// /accounts/{acct}/payments, POST /leased/payments (lease mode) and POST /search
// (key optional). The tenant comes from the X-Tenant header, as an authentication
// middleware would set it.
func setup(t *testing.T, mutate ...func(*httpidem.Config)) *bundle {
	t.Helper()
	return setupOn(t, pgtest.Options{}, mutate...)
}

// setupOn is setup with the test pool's options (a pgx query mode, say).
func setupOn(t *testing.T, opts pgtest.Options, mutate ...func(*httpidem.Config)) *bundle {
	t.Helper()
	opts.MaxConns = 24
	pool, schema := pgtest.Setup(t, opts)
	_, err := pool.Exec(context.Background(), paymentsDDL)
	require.NoError(t, err)
	b := &bundle{pool: pool, schema: schema, reg: prometheus.NewRegistry()}
	cfg := baseConfig(pool, schema)
	cfg.Registerer = b.reg
	for _, m := range mutate {
		m(&cfg)
	}
	b.mw, err = httpidem.New(cfg)
	require.NoError(t, err)
	b.srv = httptest.NewServer(routes(b.mw, b.handler))
	t.Cleanup(b.srv.Close)
	b.client = b.srv.Client()
	b.client.Timeout = 60 * time.Second
	t.Cleanup(b.client.CloseIdleConnections)
	return b
}

func baseConfig(pool *pgxpool.Pool, schema string) httpidem.Config {
	return httpidem.Config{
		Pool: pool, Schema: schema,
		Tenant:      func(r *http.Request) (string, error) { return r.Header.Get("X-Tenant"), nil },
		LockTimeout: 5 * time.Second,
	}
}

func routes(mw *httpidem.Middleware, h http.HandlerFunc) *http.ServeMux {
	mux := http.NewServeMux()
	mux.Handle("POST /payments", mw.Middleware(h))
	mux.Handle("POST /accounts/{acct}/payments", mw.Middleware(h))
	mux.Handle("POST /leased/payments", mw.Route(httpidem.Route{Lease: true})(h))
	mux.Handle("POST /search", mw.Route(httpidem.Route{KeyOptional: true, Operation: "search"})(h))
	return mux
}

func (b *bundle) setHook(f func(w http.ResponseWriter, r *http.Request) bool) { b.hook.Store(&f) }

func (b *bundle) handler(w http.ResponseWriter, r *http.Request) {
	b.calls.Add(1)
	var hook func(http.ResponseWriter, *http.Request) bool
	if h := b.hook.Load(); h != nil {
		hook = *h
	}
	createPayment(w, r, hook)
}

// createPayment is the business handler: a payment row and a receipt effect in
// idem's transaction, 201 with the payment. A non-positive amount writes an audit
// row and answers 422, which must roll back.
func createPayment(w http.ResponseWriter, r *http.Request, hook func(http.ResponseWriter, *http.Request) bool) {
	ctx := r.Context()
	tx := httpidem.Tx(ctx)
	if tx == nil {
		http.Error(w, "no transaction", http.StatusInternalServerError)
		return
	}
	var in struct {
		Amount json.Number `json:"amount"`
		Email  string      `json:"email"`
	}
	dec := json.NewDecoder(r.Body)
	dec.UseNumber()
	if err := dec.Decode(&in); err != nil || in.Amount == "" {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		_, _ = io.WriteString(w, `{"error":"not a payment"}`)
		return
	}
	if strings.HasPrefix(string(in.Amount), "-") || strings.Trim(string(in.Amount), "0.") == "" {
		if _, err := tx.Exec(ctx, `INSERT INTO audit (note) VALUES ('rejected amount')`); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusUnprocessableEntity)
		_, _ = io.WriteString(w, `{"error":"amount must be positive"}`)
		return
	}
	var id int64
	if err := tx.QueryRow(ctx, `INSERT INTO payments (tenant, amount) VALUES ($1, $2::numeric) RETURNING id`,
		r.Header.Get("X-Tenant"), in.Amount.String()).Scan(&id); err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	if _, err := effects.Enqueue(ctx, tx, effects.Effect{Kind: "email", Key: fmt.Sprintf("receipt:%d", id), Payload: []byte(in.Email)}); err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	if hook != nil && hook(w, r) {
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", fmt.Sprintf("/payments/%d", id))
	w.Header().Set("X-Served-At", time.Now().Format(time.RFC3339Nano)) // not stored
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, "{\"id\":%d,\"amount\":%q}\n", id, in.Amount.String())
}

// answer is what the client got: the status, the headers that matter and the
// body's exact bytes.
type answer struct {
	Status   int
	Header   http.Header
	Body     []byte
	Replayed bool
}

func (a answer) String() string { return fmt.Sprintf("%d %q", a.Status, a.Body) }

// defaultTenant is the X-Tenant of a request that names none: Config.Tenant
// refuses an empty tenant.
const defaultTenant = "t0"

// post sends a request; key "" sends none. Extra headers come in pairs; without an
// X-Tenant among them the request is defaultTenant's.
func (b *bundle) post(t *testing.T, path, key, body string, hdr ...string) answer {
	t.Helper()
	a, err := b.tryPost(context.Background(), path, key, body, hdr...)
	require.NoError(t, err)
	return a
}

func (b *bundle) tryPost(ctx context.Context, path, key, body string, hdr ...string) (answer, error) {
	return postTo(ctx, b.client, b.srv.URL, path, key, body, hdr...)
}

func postTo(ctx context.Context, c *http.Client, base, path, key, body string, hdr ...string) (answer, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+path, strings.NewReader(body))
	if err != nil {
		return answer{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	req.Header.Set("X-Tenant", defaultTenant)
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		return answer{}, err
	}
	defer func() { _ = resp.Body.Close() }()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return answer{}, err
	}
	return answer{Status: resp.StatusCode, Header: resp.Header, Body: raw, Replayed: resp.Header.Get("Idempotent-Replayed") == "true"}, nil
}

func (b *bundle) payments(t *testing.T) int {
	return pgtest.Count(t, b.pool, `SELECT count(*) FROM payments`)
}

func (b *bundle) count(t *testing.T, sql string, args ...any) int {
	return pgtest.Count(t, b.pool, sql, args...)
}

// requireSameAnswer: a replay has the first answer's status, stored headers and
// body byte for byte, and says it is a replay.
func requireSameAnswer(t *testing.T, first, replay answer) {
	t.Helper()
	require.False(t, first.Replayed, "the first answer is not a replay")
	require.True(t, replay.Replayed, "Idempotent-Replayed: true")
	require.Equal(t, first.Status, replay.Status)
	require.Equal(t, first.Body, replay.Body, "body byte for byte")
	for _, h := range []string{"Content-Type", "Location", "Content-Length"} {
		require.Equal(t, first.Header.Values(h), replay.Header.Values(h), h)
	}
}

// problem decodes an RFC 9457 answer and checks its envelope.
func problem(t *testing.T, a answer, status int, code string) httpidem.Problem {
	t.Helper()
	require.Equal(t, status, a.Status, "answer %s", a)
	require.Equal(t, "application/problem+json", a.Header.Get("Content-Type"))
	var p httpidem.Problem
	require.NoError(t, json.Unmarshal(a.Body, &p))
	require.Equal(t, code, p.Code)
	require.Equal(t, status, p.Status)
	require.Equal(t, httpidem.ProblemTypePrefix+code, p.Type)
	require.NotEmpty(t, p.Title)
	require.False(t, a.Replayed)
	return p
}

// counter reads one series of a counter vector: labels are the operation and, for
// vectors that have one, the second label ("" for none).
func counter(t *testing.T, reg *prometheus.Registry, name, op, second string) float64 {
	t.Helper()
	families, err := reg.Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	next:
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				switch l.GetName() {
				case "operation":
					if l.GetValue() != op {
						continue next
					}
				default:
					if second != "" && l.GetValue() != second {
						continue next
					}
				}
			}
			return m.GetCounter().GetValue()
		}
	}
	t.Fatalf("no series %s{%s,%s}", name, op, second)
	return 0
}
