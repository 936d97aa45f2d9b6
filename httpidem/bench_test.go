package httpidem_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
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
// On a machine whose CPUs are busy, requests/s follow CPU time, so it also reports
// the CPU time per request of each side: this process's ("go-µs/req": the HTTP
// server and client, pgx, the middleware) and, on Linux with Postgres on the same
// host, that of the pool's Postgres backends ("pg-µs/req", from
// /proc/<pid>/schedstat). They say where idem's cost goes, and move less than the
// rates when other work shares the machine.
//
// Two writes: one row ("row"), and what examples/http-payments does, a payment row
// and two effects ("payment+effects"). idem's cost per request is fixed (claim,
// stored response), so the heavier the write, the closer the ratio comes to 1.
//
//	go test -run '^$' -bench IdempotencyKey -benchtime 20000x ./httpidem
func BenchmarkIdempotencyKey(b *testing.B) {
	b.Run("write=row", func(b *testing.B) { benchIdempotencyKey(b, 0, 0) })
	b.Run("write=payment+effects", func(b *testing.B) { benchIdempotencyKey(b, 2, 0) })
}

// BenchmarkIdempotencyKeyRemoteDB is BenchmarkIdempotencyKey with Postgres a
// network round trip away (pg-rtt: 0.5, 1 and 2 ms, added by pgtest.Proxy, which
// holds each chunk of bytes half of it in each direction), as it is for most
// services. The middleware adds no round trip to the bare handler's three (BEGIN
// goes with the claim, COMMIT with the stored answer), only CPU; the further the
// database, the more of a request's time is waiting, and the closer the two rates.
//
//	go test -run '^$' -bench IdempotencyKeyRemoteDB -benchtime 10000x ./httpidem
func BenchmarkIdempotencyKeyRemoteDB(b *testing.B) {
	for _, rtt := range []time.Duration{500 * time.Microsecond, time.Millisecond, 2 * time.Millisecond} {
		b.Run("write=row/pg-rtt="+rtt.String(), func(b *testing.B) { benchIdempotencyKey(b, 0, rtt) })
		b.Run("write=payment+effects/pg-rtt="+rtt.String(), func(b *testing.B) { benchIdempotencyKey(b, 2, rtt) })
	}
}

func benchIdempotencyKey(b *testing.B, nEffects int, rtt time.Duration) {
	s := newBenchServer(b, nEffects, rtt)
	s.run("/bare/payments", 200) // warm up connections and plans
	s.run("/idem/payments", 200)
	type side struct {
		wall   time.Duration
		goCPU  time.Duration
		pgCPU  time.Duration
		pgSeen bool
	}
	var bare, idem side
	run := func(path string, n int, into *side) {
		before := s.cpu()
		into.wall += s.run(path, n)
		after := s.cpu()
		into.goCPU += after.self - before.self
		if d, ok := after.backendsSince(before); ok {
			into.pgCPU += d
			into.pgSeen = true
		}
	}
	b.ResetTimer()
	// Many short rounds, in ABBA order, so that the load of a shared machine
	// falls on both sides alike.
	const rounds = 20
	per := max(b.N/rounds, 1)
	for r := range rounds {
		if r%4 == 0 || r%4 == 3 {
			run("/bare/payments", per, &bare)
			run("/idem/payments", per, &idem)
		} else {
			run("/idem/payments", per, &idem)
			run("/bare/payments", per, &bare)
		}
	}
	b.StopTimer()
	n := float64(per * rounds)
	bareRate, idemRate := n/bare.wall.Seconds(), n/idem.wall.Seconds()
	b.ReportMetric(bareRate, "bare-req/s")
	b.ReportMetric(idemRate, "idem-req/s")
	b.ReportMetric(idemRate/bareRate, "idem/bare")
	perReq := func(d time.Duration) float64 { return float64(d.Microseconds()) / n }
	b.ReportMetric(perReq(bare.goCPU), "bare-go-µs/req")
	b.ReportMetric(perReq(idem.goCPU), "idem-go-µs/req")
	if bare.pgSeen && idem.pgSeen {
		b.ReportMetric(perReq(bare.pgCPU), "bare-pg-µs/req")
		b.ReportMetric(perReq(idem.pgCPU), "idem-pg-µs/req")
	}
}

// cpuSample is the CPU time used so far by this process and by each of the pool's
// Postgres backends that could be read.
type cpuSample struct {
	self     time.Duration
	backends map[int]time.Duration
}

// backendsSince is the CPU time the backends present in both samples used between
// them; false if none could be read (Postgres on another host, or not Linux).
func (a cpuSample) backendsSince(b cpuSample) (time.Duration, bool) {
	var sum time.Duration
	seen := false
	for pid, t := range a.backends {
		if t0, ok := b.backends[pid]; ok {
			sum += t - t0
			seen = true
		}
	}
	return sum, seen
}

// cpu samples the CPU time of this process and of the pool's backends.
func (s *benchServer) cpu() cpuSample {
	out := cpuSample{self: threadsCPU("/proc/self/task"), backends: map[int]time.Duration{}}
	rows, err := s.pool.Query(context.Background(), `SELECT pid FROM pg_stat_activity WHERE application_name = $1`, "idem-test:"+s.schema)
	if err != nil {
		return out
	}
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		return out
	}
	for _, pid := range pids {
		if t, ok := schedstat("/proc/" + strconv.Itoa(pid) + "/schedstat"); ok {
			out.backends[pid] = t
		}
	}
	return out
}

// threadsCPU sums the CPU time of the threads under a /proc/<pid>/task directory
// (0 where there is no /proc).
func threadsCPU(dir string) time.Duration {
	ents, _ := os.ReadDir(dir)
	var sum time.Duration
	for _, e := range ents {
		if t, ok := schedstat(dir + "/" + e.Name() + "/schedstat"); ok {
			sum += t
		}
	}
	return sum
}

// schedstat reads the time on CPU from a schedstat file: its first field, in ns.
func schedstat(path string) (time.Duration, bool) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	f := strings.Fields(string(raw))
	if len(f) == 0 {
		return 0, false
	}
	ns, err := strconv.ParseInt(f[0], 10, 64)
	return time.Duration(ns), err == nil
}

// benchClients is the benchmark's concurrency: client connections, and requests in
// flight.
const benchClients = 16

// benchServer is the benchmark's server, with POST /bare/payments and POST
// /idem/payments doing the same write.
type benchServer struct {
	pool   *pgxpool.Pool
	schema string
	// run sends n requests to path from benchClients clients and returns how long
	// that took.
	run func(path string, n int) time.Duration
}

func newBenchServer(b testing.TB, nEffects int, rtt time.Duration) *benchServer {
	const clients = benchClients
	pool, schema := pgtest.Setup(b, pgtest.Options{MaxConns: clients + 2})
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE payments (id bigserial PRIMARY KEY, tenant text NOT NULL, amount numeric NOT NULL)`)
	require.NoError(b, err)
	if rtt > 0 {
		// Both handlers and the CPU sampling use the remote pool; its backends are
		// the ones measured.
		pool.Close()
		pool = pgtest.NewProxy(b, rtt).Pool(b, schema, pgtest.Options{MaxConns: clients + 2})
	}
	mw, err := httpidem.New(httpidem.Config{Pool: pool, Schema: schema, Unscoped: true})
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
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		defer tx.Rollback(context.WithoutCancel(r.Context()))
		id, amount, err := insert(r, tx)
		if err == nil {
			err = tx.Commit(r.Context())
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		answer(w, id, amount)
	})
	mux.Handle("POST /idem/payments", mw.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id, amount, err := insert(r, httpidem.Tx(r.Context()))
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
