// Command http is docs/http.md's first endpoint: POST /docs-http/payments
// behind httpidem's middleware on a net/http server. A client sends the same
// request twice with one Idempotency-Key; the handler runs once, and the
// retry gets the stored answer.
package main

import (
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/httpidem"
	"github.com/idemkit/idem/migrate"
)

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool := must(pgxpool.New(ctx, os.Getenv("DATABASE_URL")))
	defer pool.Close()
	m := must(migrate.New(migrate.Config{Pool: pool, Schema: "docs_http"})) // idem's tables
	must(m.Up(ctx))
	must(pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS docs_http.payments (id bigserial, amount int)`))
	idem, err := httpidem.New(httpidem.Config{
		Pool: pool, Schema: "docs_http",
		// Whose key it is: the tenant your authentication found, never a header a client sets.
		Tenant: func(r *http.Request) (string, error) { return "tenant-1", nil },
	})
	check(err)

	mux := http.NewServeMux()
	mux.Handle("POST /docs-http/payments", idem.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var id int64 // httpidem.Tx is the key's transaction: the insert and the answer commit together
		err := httpidem.Tx(r.Context()).QueryRow(r.Context(),
			`INSERT INTO docs_http.payments (amount) VALUES (42) RETURNING id`).Scan(&id)
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable) // a 5xx stores nothing: a retry runs again
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d}`, id)
	})))
	ln := must(net.Listen("tcp", "127.0.0.1:0")) // any free port; ":8080" in a service
	go func() { _ = http.Serve(ln, mux) }()

	key := rand.Text() // the client's Idempotency-Key: a new one each run
	var bodies []string
	for range 2 { // a client that retries
		req := must(http.NewRequest(http.MethodPost, "http://"+ln.Addr().String()+"/docs-http/payments", strings.NewReader(`{"amount":42}`)))
		req.Header.Set("Idempotency-Key", key)
		resp, err := http.DefaultClient.Do(req)
		check(err)
		body := must(io.ReadAll(resp.Body))
		_ = resp.Body.Close()
		bodies = append(bodies, string(body))
		fmt.Println(resp.StatusCode, "replayed:", resp.Header.Get(httpidem.ReplayedHeader) == "true")
	}
	var id, rows int64
	must(fmt.Sscanf(bodies[0], `{"id":%d}`, &id))
	check(pool.QueryRow(ctx, `SELECT count(*) FROM docs_http.payments WHERE id = $1`, id).Scan(&rows))
	fmt.Println("same body:", bodies[0] == bodies[1], "payment rows:", rows)
}

// must and check stop the program on an error; a service would return it.
func must[T any](v T, err error) T {
	check(err)
	return v
}

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}
