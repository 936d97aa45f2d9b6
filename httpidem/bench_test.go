package httpidem_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/httpidem"
	"github.com/idemkit/idem/internal/pgtest"
)

// BenchmarkIdempotencyKey compares requests/s through the middleware with a bare
// handler that does the same write in its own transaction, side by side in one
// run: the same server, client, pool and concurrency, in alternating rounds so
// that drift on a shared machine hits both. It reports both rates and their ratio
// (idem/bare). Each idem request has a new key: the cost measured is a first run
// (claim, write, stored response, commit), not a cheap replay.
//
// Two writes: one row ("row"), and what examples/http-payments does, a payment row
// and two effects ("payment+effects"). idem's cost per request is fixed (claim,
// stored response), so the heavier the write, the closer the ratio comes to 1.
//
//	go test -run '^$' -bench IdempotencyKey -benchtime 20000x ./httpidem
func BenchmarkIdempotencyKey(b *testing.B) {
	b.Run("write=row", func(b *testing.B) { benchIdempotencyKey(b, 0) })
	b.Run("write=payment+effects", func(b *testing.B) { benchIdempotencyKey(b, 2) })
}

func benchIdempotencyKey(b *testing.B, nEffects int) {
	const clients = 16
	pool, schema := pgtest.Setup(b, pgtest.Options{MaxConns: clients + 2})
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE payments (id bigserial PRIMARY KEY, tenant text NOT NULL, amount numeric NOT NULL)`)
	require.NoError(b, err)
	mw, err := httpidem.New(httpidem.Config{Pool: pool, Schema: schema})
	require.NoError(b, err)

	// Both handlers read the body, insert one row and answer 201 with it; the bare
	// one commits first and then answers, as a careful handler must.
	insert := func(r *http.Request, tx pgx.Tx) (int64, string, error) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			return 0, "", err
		}
		amount := strings.TrimSuffix(strings.TrimPrefix(string(body), `{"amount":`), `}`)
		var id int64
		err = tx.QueryRow(r.Context(), `INSERT INTO payments (tenant, amount) VALUES ('', $1::numeric) RETURNING id`, amount).Scan(&id)
		scope := effects.Scope{Schema: schema} // the middleware's scope, when there is one
		if s, ok := effects.ScopeFrom(r.Context()); ok {
			scope = s
		}
		for i := range nEffects {
			if err != nil {
				break
			}
			_, err = effects.EnqueueScoped(r.Context(), tx, scope, effects.Effect{Kind: "email", Key: fmt.Sprintf("receipt:%d:%d", id, i), Payload: body})
		}
		return id, amount, err
	}
	answer := func(w http.ResponseWriter, id int64, amount string) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/payments/"+strconv.FormatInt(id, 10))
		w.WriteHeader(http.StatusCreated)
		_, _ = fmt.Fprintf(w, `{"id":%d,"amount":%s}`, id, amount)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /bare/payments", func(w http.ResponseWriter, r *http.Request) {
		tx, err := pool.Begin(r.Context())
		if err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		defer tx.Rollback(context.WithoutCancel(r.Context()))
		id, amount, err := insert(r, tx)
		if err == nil {
			err = tx.Commit(r.Context())
		}
		if err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		answer(w, id, amount)
	})
	mux.Handle("POST /idem/payments", mw.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id, amount, err := insert(r, httpidem.Tx(r.Context()))
		if err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		answer(w, id, amount)
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: clients, MaxConnsPerHost: clients}}
	defer client.CloseIdleConnections()

	var seq atomic.Int64
	run := func(path string, n int) time.Duration {
		var next atomic.Int64
		var wg sync.WaitGroup
		start := time.Now()
		for range clients {
			wg.Go(func() {
				for next.Add(1) <= int64(n) {
					i := seq.Add(1)
					req, _ := http.NewRequest(http.MethodPost, srv.URL+path, strings.NewReader(fmt.Sprintf(`{"amount":%d}`, i)))
					req.Header.Set("Content-Type", "application/json")
					req.Header.Set("Idempotency-Key", "bench-"+strconv.FormatInt(i, 10))
					resp, err := client.Do(req)
					if err != nil {
						b.Error(err)
						return
					}
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if resp.StatusCode != http.StatusCreated {
						b.Errorf("%s: status %d", path, resp.StatusCode)
						return
					}
				}
			})
		}
		wg.Wait()
		return time.Since(start)
	}

	run("/bare/payments", 200) // warm up connections and plans
	run("/idem/payments", 200)
	b.ResetTimer()
	// Many short rounds, in ABBA order, so that the load of a shared machine
	// falls on both sides alike.
	const rounds = 20
	per := max(b.N/rounds, 1)
	var bare, idem time.Duration
	for r := range rounds {
		if r%4 == 0 || r%4 == 3 {
			bare += run("/bare/payments", per)
			idem += run("/idem/payments", per)
		} else {
			idem += run("/idem/payments", per)
			bare += run("/bare/payments", per)
		}
	}
	b.StopTimer()
	n := float64(per * rounds)
	bareRate, idemRate := n/bare.Seconds(), n/idem.Seconds()
	b.ReportMetric(bareRate, "bare-req/s")
	b.ReportMetric(idemRate, "idem-req/s")
	b.ReportMetric(idemRate/bareRate, "idem/bare")
}
