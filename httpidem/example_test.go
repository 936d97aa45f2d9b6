package httpidem_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/httpidem"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/migrate"
)

// A client retries POST /payments with the same Idempotency-Key: the handler
// runs once, and the retry gets the stored answer byte for byte.
func ExampleNew() {
	pool, schema, cleanup := exampleDB(`CREATE TABLE payments (id bigserial, amount int)`)
	defer cleanup()

	idem, err := httpidem.New(httpidem.Config{
		Pool:   pool,
		Schema: schema,
		Tenant: func(r *http.Request) (string, error) { return r.Header.Get("X-Tenant"), nil }, // after authentication
	})
	if err != nil {
		panic(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /payments", idem.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		tx := httpidem.Tx(ctx) // the key's transaction
		var id int64
		if err := tx.QueryRow(ctx, `INSERT INTO payments (amount) VALUES (42) RETURNING id`).Scan(&id); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if _, err := effects.Enqueue(ctx, tx, effects.Effect{
			Kind: "email", Key: fmt.Sprintf("receipt:%d", id), Payload: []byte(`{}`),
		}); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d}`, id)
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	for range 2 {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/payments", strings.NewReader(`{"amount":42}`))
		req.Header.Set("Idempotency-Key", "8e03978e-40d5-43e8-bc93-6894a57f9324")
		req.Header.Set("X-Tenant", "acme")
		resp, err := srv.Client().Do(req)
		if err != nil {
			panic(err)
		}
		body, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		fmt.Println(resp.StatusCode, string(body), "replayed:", resp.Header.Get(httpidem.ReplayedHeader) == "true")
	}
	// Output:
	// 201 {"id":1} replayed: false
	// 201 {"id":1} replayed: true
}

// Route sets options for one route: here lease mode, for a handler that calls a
// provider itself. The key commits first as in progress with a lease; if that
// attempt dies, Recover asks the provider what happened before anything runs
// again.
func ExampleMiddleware_Route() {
	pool, schema, cleanup := exampleDB()
	defer cleanup()

	charged := map[string]bool{} // the provider's own record, by idempotency key
	idem, err := httpidem.New(httpidem.Config{
		Pool:     pool,
		Schema:   schema,
		Unscoped: true, // one trusted client
		Lease: httpidem.Lease{Recover: func(ctx context.Context, s httpidem.Stale) (*httpidem.Response, error) {
			if charged[s.Key] { // the provider did the work: settle with its answer
				return &httpidem.Response{Status: http.StatusOK, Body: []byte(`{"charged":true}`)}, nil
			}
			return nil, nil // run the handler again
		}},
	})
	if err != nil {
		panic(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /charges", idem.Route(httpidem.Route{Operation: "charge", Lease: true})(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			key, _ := httpidem.KeyFrom(r.Context())
			charged[key.Key] = true // the provider call, with the key as its idempotency key
			fmt.Fprint(w, `{"charged":true}`)
		})))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/charges", strings.NewReader(`{"amount":42}`))
	req.Header.Set("Idempotency-Key", "charge-1")
	resp, err := srv.Client().Do(req)
	if err != nil {
		panic(err)
	}
	body, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	fmt.Println(resp.StatusCode, string(body))
	// Output: 200 {"charged":true}
}

// exampleDB is the examples' test plumbing: a pool on the test database
// (DATABASE_URL) whose search_path is a fresh schema, migrated, with the
// business tables of ddl. A service migrates the default "idem" schema once
// (migrate.Migrator.Up or `idem migrate up`). cleanup drops the schema.
func exampleDB(ddl ...string) (pool *pgxpool.Pool, schema string, cleanup func()) {
	ctx := context.Background()
	schema = pgtest.NewSchemaName()
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	if err != nil {
		panic(err)
	}
	cfg.MaxConns = 4
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	if pool, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
		panic(err)
	}
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: schema})
	if err != nil {
		panic(err)
	}
	if _, err := m.Up(ctx); err != nil {
		panic(err)
	}
	for _, q := range ddl {
		if _, err := pool.Exec(ctx, q); err != nil {
			panic(err)
		}
	}
	return pool, schema, func() {
		_, _ = pool.Exec(ctx, `DROP SCHEMA `+pgx.Identifier{schema}.Sanitize()+` CASCADE`)
		pool.Close()
	}
}
