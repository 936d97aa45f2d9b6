package httpidem_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/httpidem"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/pgtest"
)

// lockWaits counts the statements on schema's inbox that wait for a lock, as
// Citus's citus_lock_waits shows them from the coordinator (the wait is on a
// worker, which the coordinator's pg_stat_activity does not show).
const lockWaits = `SELECT count(*) FROM citus_lock_waits WHERE blocked_statement LIKE '%' || $1 || '%inbox%'`

// citusLedger is a schema on the Citus coordinator migrated in Citus mode, with a
// business table distributed by tenant and colocated with idem's tables.
func citusLedger(t *testing.T, opts pgtest.Options) (*pgxpool.Pool, string) {
	t.Helper()
	pool, schema := pgtest.CitusSetup(t, opts)
	_, err := pool.Exec(context.Background(), `CREATE TABLE ledger (tenant text NOT NULL, key text NOT NULL, PRIMARY KEY (tenant, key))`)
	require.NoError(t, err)
	pgtest.Distribute(t, pool, schema, "ledger")
	return pool, schema
}

// citusServer is a middleware on pool (Tenant from X-Tenant) whose handler
// writes a ledger row, ends the transaction itself on path /end, and answers 422
// on /fail; do sends one request to the route of mode (lease or not).
func citusServer(t *testing.T, pool *pgxpool.Pool, schema string, mutate func(*httpidem.Config)) func(lease bool, tenant, path, key, body string) *httptest.ResponseRecorder {
	cfg := httpidem.Config{Pool: pool, Schema: schema, Registerer: prometheus.NewRegistry(),
		Tenant: func(r *http.Request) (string, error) { return r.Header.Get("X-Tenant"), nil }}
	if mutate != nil {
		mutate(&cfg)
	}
	m, err := httpidem.New(cfg)
	require.NoError(t, err)
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/fail" {
			http.Error(w, "no", http.StatusUnprocessableEntity)
			return
		}
		tx := httpidem.Tx(r.Context())
		if _, err := tx.Exec(r.Context(), `INSERT INTO ledger (tenant, key) VALUES ($1, $2)`,
			r.Header.Get("X-Tenant"), r.Header.Get("X-Mode")+r.URL.Path+":"+r.Header.Get("Idempotency-Key")); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if r.URL.Path == "/end" {
			_, _ = tx.Exec(r.Context(), "COMMIT; BEGIN")
		}
		w.WriteHeader(http.StatusCreated)
	})
	routes := map[bool]http.Handler{}
	for _, lease := range []bool{false, true} {
		routes[lease] = m.Route(httpidem.Route{Operation: fmt.Sprintf("pay-%v", lease), Lease: lease})(handler)
	}
	return func(lease bool, tenant, path, key, body string) *httptest.ResponseRecorder {
		r := httptest.NewRequest(http.MethodPost, path, strings.NewReader(body))
		r.Header.Set("X-Tenant", tenant)
		r.Header.Set("Idempotency-Key", key)
		r.Header.Set("X-Mode", fmt.Sprint(lease))
		w := httptest.NewRecorder()
		routes[lease].ServeHTTP(w, r)
		return w
	}
}

// On Citus, httpidem in both modes (and in pgx's prepared and unprepared query
// modes) stores a request's response with its ledger row on the tenant's worker,
// replays it byte for byte, refuses the key with another body, stores and replays
// a failure, and catches a handler that ends the transaction itself (COMMIT;
// BEGIN): the mark, checked with the response's write, is gone, and no response
// is stored for that key but the problem that says so.
func TestCitusBothModes(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeExec} {
		t.Run(mode.String(), func(t *testing.T) {
			pool, schema := citusLedger(t, pgtest.Options{MaxConns: 6, QueryExecMode: mode})
			do := citusServer(t, pool, schema, nil)
			for _, lease := range []bool{false, true} {
				for _, tenant := range []string{"a", "b", "c"} {
					first := do(lease, tenant, "/pay", "k1", `{"n":1}`)
					require.Equal(t, http.StatusCreated, first.Code, first.Body.String())
					replay := do(lease, tenant, "/pay", "k1", `{"n":1}`)
					require.Equal(t, http.StatusCreated, replay.Code)
					require.Equal(t, first.Body.Bytes(), replay.Body.Bytes())
					require.Equal(t, http.StatusUnprocessableEntity, do(lease, tenant, "/pay", "k1", `{"n":2}`).Code, "mismatch")
					failed := do(lease, tenant, "/fail", "k2", `{}`)
					require.Equal(t, http.StatusUnprocessableEntity, failed.Code)
					require.Equal(t, failed.Body.Bytes(), do(lease, tenant, "/fail", "k2", `{}`).Body.Bytes(), "replay of the failure")
					ended := do(lease, tenant, "/end", "k3", `{}`)
					require.Equal(t, http.StatusInternalServerError, ended.Code, ended.Body.String())
					require.Regexp(t, `"code":"handler_(committed|ended_transaction)"`, ended.Body.String())
				}
				op := fmt.Sprintf("pay-%v", lease)
				require.Equal(t, 3, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE consumer = $1 AND key = 'k1' AND state = 'completed' AND response_status = 201`, op))
				require.Equal(t, 3, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE consumer = $1 AND key = 'k2' AND response_status = 422`, op))
			}
			require.Equal(t, 6, pgtest.Count(t, pool, `SELECT count(*) FROM ledger WHERE key LIKE '%/pay:k1'`))
			// The handler's COMMIT of /end committed its own row in the transactional
			// mode (that COMMIT is the handler's), but never a stored response.
			require.Zero(t, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE key = 'k3' AND response_status = 201`))
		})
	}
}

// On Citus, LockTimeout bounds the wait for a concurrent request's key on the
// worker that holds it: citus_lock_waits shows the request's claim waiting, and
// then the request is answered 409, its wait gone, while the holder still holds
// the key.
func TestCitusLockTimeoutReachesTheWorker(t *testing.T) {
	t.Parallel()
	pool, schema := citusLedger(t, pgtest.Options{MaxConns: 6})
	do := citusServer(t, pool, schema, func(c *httpidem.Config) { c.LockTimeout = 3 * time.Second })
	ctx := context.Background()
	store, err := inboxdb.NewStore(schema)
	require.NoError(t, err)
	holder, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(ctx) }()
	res, err := store.ClaimTx(ctx, holder, inboxdb.Claim{ID: inboxdb.ID{Consumer: "pay-false", Tenant: "a", Key: "held"}, Fingerprint: []byte{1}})
	require.NoError(t, err)
	require.True(t, res.Claimed)
	done := make(chan *httptest.ResponseRecorder, 1)
	go func() { done <- do(false, "a", "/pay", "held", `{}`) }()
	pgtest.WaitFor(t, 3*time.Second, "the claim waiting for the held key", func() bool {
		return pgtest.Count(t, pool, lockWaits, schema) == 1
	})
	var w *httptest.ResponseRecorder
	select {
	case w = <-done:
	case <-time.After(20 * time.Second):
		// Show that the request waits on a worker, then let it go.
		waits := pgtest.Count(t, pool, `SELECT count(*) FROM citus_lock_waits`)
		require.NoError(t, holder.Rollback(ctx))
		<-done
		t.Fatalf("the request still waited for the held key after 20 s (%d lock waits on the workers)", waits)
	}
	require.Equal(t, http.StatusConflict, w.Code, w.Body.String())
	require.Zero(t, pgtest.Count(t, pool, lockWaits, schema), "the wait ended on the worker")
	require.NoError(t, holder.Rollback(ctx))
	require.Equal(t, http.StatusCreated, do(false, "a", "/pay", "held", `{}`).Code)
}

// On Citus, a request's claim and its Enqueue (both modes) are statements that
// Citus routes to the tenant's worker as they are: no intermediate result goes to
// or from a worker, no transaction commits with two-phase commit, and the effect
// is stored once across a replay.
func TestCitusRequestsAreRoutedAsTheyAre(t *testing.T) {
	t.Parallel()
	base, schema := citusLedger(t, pgtest.Options{MaxConns: 6})
	pool, remote := pgtest.CitusRemoteLog(t, base)
	m, err := httpidem.New(httpidem.Config{Pool: pool, Schema: schema, Registerer: prometheus.NewRegistry(),
		Tenant: func(r *http.Request) (string, error) { return r.Header.Get("X-Tenant"), nil }})
	require.NoError(t, err)
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		if _, err := effects.Enqueue(ctx, httpidem.Tx(ctx), effects.Effect{Kind: "email", Key: "receipt:" + r.Header.Get("Idempotency-Key")}); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	for _, lease := range []bool{false, true} {
		h := m.Route(httpidem.Route{Operation: fmt.Sprintf("pay-%v", lease), Lease: lease})(handler)
		key := fmt.Sprintf("k-%v", lease)
		for range 2 { // the second is a replay
			r := httptest.NewRequest(http.MethodPost, "/pay", strings.NewReader(`{}`))
			r.Header.Set("X-Tenant", "a")
			r.Header.Set("Idempotency-Key", key)
			w := httptest.NewRecorder()
			h.ServeHTTP(w, r)
			require.Equal(t, http.StatusCreated, w.Code, "lease %v: %s", lease, w.Body)
		}
		require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE tenant = 'a' AND key = $1`, "receipt:"+key))
	}
	require.Positive(t, remote.Count("issuing "), "the pool logs what Citus sends to the workers")
	require.Empty(t, remote.Matching("read_intermediate_result"), "a statement went through the coordinator's recursive planning")
	require.Empty(t, remote.Matching("PREPARE TRANSACTION"), "a request committed with two-phase commit")
}
