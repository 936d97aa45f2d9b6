package httpidem_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
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
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/httpidem"
	"github.com/idemkit/idem/internal/cpustat"
	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/pgtest"
)

// BenchmarkIdempotencyKey compares requests/s through the middleware with two
// handlers that do the same write without it, side by side in one run: the same
// server, client, pool and concurrency, in rounds whose order turns through every
// permutation so that drift on a shared machine hits all three alike. The sides:
//
//   - bare: the write in a transaction of its own (BEGIN, write, COMMIT, then the
//     answer), with no key at all;
//   - recipe: the claim-first recipe written by hand, as the articles idem grew
//     from describe it, on a table of the inbox's shape (LIKE inbox INCLUDING ALL):
//     BEGIN, INSERT of the key row (ON CONFLICT DO NOTHING; a conflict reads the
//     stored answer and replays it, or answers 422 for another body), the write,
//     an UPDATE with the answer, COMMIT, then the answer;
//   - idem: the same handler as bare's, behind the middleware.
//
// Each keyed request has a new key: the cost measured is a first run, not a cheap
// replay. It reports the rates and the ratios idem/bare and idem/recipe.
//
// On a machine whose CPUs are busy, requests/s follow CPU time, so it also reports
// per request and side (internal/cpustat): this process's CPU time ("go-µs/req": the
// HTTP server and client, pgx, the middleware), that of the pool's Postgres
// backends ("pg-µs/req"; Linux with Postgres on the same host), and this process's
// heap allocations ("allocs/req", "B/req"). "idem-overhead-go-µs/req" is idem's Go
// CPU less bare's: what the middleware adds, its statements' client side included.
//
// Two writes: one row ("row"), and what examples/http-payments does, a payment row
// and two effects ("payment+effects"). idem's cost per request is fixed (claim,
// stored response), so the heavier the write, the closer the ratio comes to 1.
//
//	go test -run '^$' -bench 'IdempotencyKey$' -benchtime 12000x ./httpidem
func BenchmarkIdempotencyKey(b *testing.B) {
	b.Run("write=row", func(b *testing.B) { benchIdempotencyKey(b, 0, 0) })
	b.Run("write=payment+effects", func(b *testing.B) { benchIdempotencyKey(b, 2, 0) })
}

// BenchmarkIdempotencyKeyRemoteDB is BenchmarkIdempotencyKey with Postgres a
// network round trip away (pg-rtt: 0.5, 1 and 2 ms, added by pgtest.Proxy, which
// holds each chunk of bytes half of it in each direction), as it is for most
// services. The middleware adds no round trip to the bare handler's three (BEGIN
// goes with the claim, COMMIT with the stored answer), only CPU; the recipe, with
// pgx's Tx, takes five. The further the database, the more of a request's time is
// waiting, and the closer idem's rate comes to bare's.
//
//	go test -run '^$' -bench IdempotencyKeyRemoteDB -benchtime 6000x ./httpidem
func BenchmarkIdempotencyKeyRemoteDB(b *testing.B) {
	for _, rtt := range []time.Duration{500 * time.Microsecond, time.Millisecond, 2 * time.Millisecond} {
		b.Run("write=row/pg-rtt="+rtt.String(), func(b *testing.B) { benchIdempotencyKey(b, 0, rtt) })
		b.Run("write=payment+effects/pg-rtt="+rtt.String(), func(b *testing.B) { benchIdempotencyKey(b, 2, rtt) })
	}
}

// BenchmarkIdempotencyKeyAlone runs one side of BenchmarkIdempotencyKey on its
// own (one-row write, loopback), for a CPU or allocation profile of that side
// alone:
//
//	go test -run '^$' -bench 'IdempotencyKeyAlone/idem' -benchtime 20000x -cpuprofile cpu.out ./httpidem
func BenchmarkIdempotencyKeyAlone(b *testing.B) {
	for _, side := range benchSides {
		b.Run(side, func(b *testing.B) {
			s := newBenchServer(b, 0, 0)
			s.run("/"+side+"/payments", 200)
			ctx, app := context.Background(), "idem-test:"+s.schema
			before := cpustat.Take(ctx, s.pool, app)
			b.ResetTimer()
			wall := s.run("/"+side+"/payments", b.N)
			b.StopTimer()
			reportCost(b, "", cpustat.Take(ctx, s.pool, app).Since(before), b.N)
			b.ReportMetric(float64(b.N)/wall.Seconds(), "req/s")
		})
	}
}

// addDelta sums the costs of two stretches of work: their GC shares weighted by
// their CPU time.
func addDelta(a, b cpustat.Delta) cpustat.Delta {
	sum := cpustat.Delta{Self: a.Self + b.Self, Mallocs: a.Mallocs + b.Mallocs, AllocBytes: a.AllocBytes + b.AllocBytes,
		Backends: a.Backends + b.Backends, BackendsSeen: a.BackendsSeen || b.BackendsSeen}
	if sum.Self > 0 {
		sum.GCShare = (a.GCShare*float64(a.Self) + b.GCShare*float64(b.Self)) / float64(sum.Self)
	}
	return sum
}

// reportCost reports d over n requests, each figure's unit prefixed with prefix:
// Go and Postgres CPU µs, the Go GC's share of the Go µs (the runtime's
// estimate), heap allocations and bytes.
func reportCost(b *testing.B, prefix string, d cpustat.Delta, n int) {
	b.ReportMetric(cpustat.PerOp(d.Self, n), prefix+"go-µs/req")
	b.ReportMetric(d.GCShare*cpustat.PerOp(d.Self, n), prefix+"gc-µs/req")
	if d.BackendsSeen {
		b.ReportMetric(cpustat.PerOp(d.Backends, n), prefix+"pg-µs/req")
	}
	b.ReportMetric(float64(d.Mallocs)/float64(n), prefix+"allocs/req")
	b.ReportMetric(float64(d.AllocBytes)/float64(n), prefix+"B/req")
}

// The benchmark's sides, by path.
var benchSides = [...]string{"bare", "recipe", "idem"}

func benchIdempotencyKey(b *testing.B, nEffects int, rtt time.Duration) {
	s := newBenchServer(b, nEffects, rtt)
	for _, side := range benchSides {
		s.run("/"+side+"/payments", 200) // warm up connections and plans
	}
	type result struct {
		wall time.Duration
		cost cpustat.Delta
	}
	var res [len(benchSides)]result
	app := "idem-test:" + s.schema // pgtest's application_name for the pool
	run := func(i, n int) {
		ctx := context.Background()
		before := cpustat.Take(ctx, s.pool, app)
		wall := s.run("/"+benchSides[i]+"/payments", n)
		d := cpustat.Take(ctx, s.pool, app).Since(before)
		res[i].cost = addDelta(res[i].cost, d)
		res[i].wall += wall
	}
	// Many short rounds, in every order of the three sides in turn, so that the
	// load of a shared machine falls on all alike.
	orders := [][3]int{{0, 1, 2}, {2, 1, 0}, {1, 2, 0}, {0, 2, 1}, {2, 0, 1}, {1, 0, 2}}
	const rounds = 24
	per := max(b.N/rounds, 1)
	b.ResetTimer()
	for r := range rounds {
		for _, i := range orders[r%len(orders)] {
			run(i, per)
		}
	}
	b.StopTimer()
	n := per * rounds
	var rate [len(benchSides)]float64
	for i, side := range benchSides {
		rate[i] = float64(n) / res[i].wall.Seconds()
		reportCost(b, side+"-", res[i].cost, n)
		b.ReportMetric(rate[i], side+"-req/s")
	}
	b.ReportMetric(rate[2]/rate[0], "idem/bare")
	b.ReportMetric(rate[2]/rate[1], "idem/recipe")
	b.ReportMetric(cpustat.PerOp(res[2].cost.Self-res[0].cost.Self, n), "idem-overhead-go-µs/req")
}

// benchClients is the benchmark's concurrency: client connections, and requests in
// flight.
const benchClients = 16

// benchServer is the benchmark's server, with POST /bare/payments, POST
// /recipe/payments and POST /idem/payments doing the same write.
type benchServer struct {
	pool   *pgxpool.Pool
	schema string
	// run sends n requests to path from benchClients clients and returns how long
	// that took.
	run func(path string, n int) time.Duration
}

// recipeOperation is the operation name of the recipe's key rows.
const recipeOperation = "POST /payments"

func newBenchServer(b testing.TB, nEffects int, rtt time.Duration) *benchServer {
	const clients = benchClients
	pool, schema := pgtest.Setup(b, pgtest.Options{MaxConns: clients + 2})
	ctx := context.Background()
	// The recipe's key table has the inbox's shape: its columns, defaults, CHECK,
	// primary key and expiry index.
	_, err := pool.Exec(ctx, `CREATE TABLE payments (id bigserial PRIMARY KEY, tenant text NOT NULL, amount numeric NOT NULL);
		CREATE TABLE recipe_keys (LIKE inbox INCLUDING ALL)`)
	require.NoError(b, err)
	if rtt > 0 {
		// Every handler and the CPU sampling use the remote pool; its backends are
		// the ones measured.
		pool.Close()
		pool = pgtest.NewProxy(b, rtt).Pool(b, schema, pgtest.Options{MaxConns: clients + 2})
	}
	mw, err := httpidem.New(httpidem.Config{Pool: pool, Schema: schema, Unscoped: true})
	require.NoError(b, err)

	// Every side inserts one row (and nEffects effects) and answers 201 with it,
	// after its commit.
	insert := func(ctx context.Context, body []byte, tx pgx.Tx) (int64, string, error) {
		amount := strings.TrimSuffix(strings.TrimPrefix(string(body), `{"amount":`), `}`)
		var id int64
		err := tx.QueryRow(ctx, `INSERT INTO payments (tenant, amount) VALUES ('', $1::numeric) RETURNING id`, amount).Scan(&id)
		scope := effectsdb.Scope{Schema: schema} // the middleware's scope, when there is one
		if s, ok := effectsdb.ScopeFrom(ctx); ok {
			scope = s
		}
		for i := range nEffects {
			if err != nil {
				break
			}
			_, err = effectsdb.Enqueue(ctx, tx, scope, effectsdb.Effect{Kind: "email", Key: fmt.Sprintf("receipt:%d:%d", id, i), Payload: body})
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
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		tx, err := pool.Begin(r.Context())
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		defer tx.Rollback(context.WithoutCancel(r.Context()))
		id, amount, err := insert(r.Context(), body, tx)
		if err == nil {
			err = tx.Commit(r.Context())
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		answer(w, id, amount)
	})
	mux.HandleFunc("POST /recipe/payments", func(w http.ResponseWriter, r *http.Request) {
		recipe(w, r, pool, func(ctx context.Context, tx pgx.Tx, body []byte) (*recipeAnswer, error) {
			id, amount, err := insert(ctx, body, tx)
			if err != nil {
				return nil, err
			}
			return &recipeAnswer{status: http.StatusCreated, location: "/payments/" + strconv.FormatInt(id, 10),
				body: fmt.Appendf(nil, `{"id":%d,"amount":%s}`, id, amount)}, nil
		})
	})
	mux.Handle("POST /idem/payments", mw.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		id, amount, err := insert(r.Context(), body, httpidem.Tx(r.Context()))
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		answer(w, id, amount)
	})))
	srv := httptest.NewServer(mux)
	b.Cleanup(srv.Close)
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: clients, MaxConnsPerHost: clients}}
	b.Cleanup(client.CloseIdleConnections)

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
					_ = resp.Body.Close()
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
	return &benchServer{pool: pool, schema: schema, run: run}
}

// recipeAnswer is what the recipe's business logic answers.
type recipeAnswer struct {
	status   int
	location string
	body     []byte
}

// recipe is the claim-first recipe written by hand, as a careful user would,
// with what it can promise: the key row goes in first, in the request's
// transaction (a concurrent request with the key waits on its unique index, then
// finds it), the work runs, the answer is stored on the row, and the transaction
// commits before the answer goes out. A key that has a row is answered from it:
// the stored answer, 422 if the body's hash differs, 409 if it has no answer. It
// runs the work in pgx's Tx (BEGIN and COMMIT each a round trip of its own).
func recipe(w http.ResponseWriter, r *http.Request, pool *pgxpool.Pool, work func(context.Context, pgx.Tx, []byte) (*recipeAnswer, error)) {
	ctx := r.Context()
	key := r.Header.Get("Idempotency-Key")
	if key == "" {
		http.Error(w, "Idempotency-Key required", http.StatusBadRequest)
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	hash := sha256.Sum256(body)
	tx, err := pool.Begin(ctx)
	if err != nil {
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
		return
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	var claimed bool
	err = tx.QueryRow(ctx, `INSERT INTO recipe_keys (consumer, key, fingerprint, state, expires_at)
		VALUES ($1, $2, $3, 'processing', now() + interval '24 hours')
		ON CONFLICT (consumer, tenant, key) DO NOTHING RETURNING true`, recipeOperation, key, hash[:]).Scan(&claimed)
	if errors.Is(err, pgx.ErrNoRows) {
		var (
			fp, headers, stored []byte
			status              *int16
		)
		err = tx.QueryRow(ctx, `SELECT fingerprint, response_status, response_headers, response_body FROM recipe_keys
			WHERE consumer = $1 AND tenant = '' AND key = $2`, recipeOperation, key).Scan(&fp, &status, &headers, &stored)
		switch {
		case err != nil:
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
		case !bytes.Equal(fp, hash[:]):
			http.Error(w, "key reused with another body", http.StatusUnprocessableEntity)
		case status == nil:
			http.Error(w, "in progress", http.StatusConflict)
		default:
			for line := range strings.SplitSeq(strings.TrimSuffix(string(headers), "\r\n"), "\r\n") {
				name, value, _ := strings.Cut(line, ": ")
				w.Header().Add(name, value)
			}
			w.Header().Set("Idempotent-Replayed", "true")
			w.WriteHeader(int(*status))
			_, _ = w.Write(stored)
		}
		return
	}
	if err != nil {
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
		return
	}
	a, err := work(ctx, tx, body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	headers := "Content-Type: application/json\r\nLocation: " + a.location + "\r\n"
	if _, err := tx.Exec(ctx, `UPDATE recipe_keys SET state = 'completed', completed_at = now(),
			response_status = $3, response_headers = $4, response_body = $5
		WHERE consumer = $1 AND tenant = '' AND key = $2`, recipeOperation, key, int16(a.status), []byte(headers), a.body); err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	if err := tx.Commit(ctx); err != nil {
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", a.location)
	w.WriteHeader(a.status)
	_, _ = w.Write(a.body)
}
