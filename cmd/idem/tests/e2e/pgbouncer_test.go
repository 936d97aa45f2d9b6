package e2e

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/httpidem"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/internal/redact"
	"github.com/idemkit/idem/migrate"
)

// TestBehindPgBouncer runs idem through a PgBouncer in transaction pooling mode
// (PGBOUNCER_URL; scripts/services starts one, and CI sets it), in the two pgx
// query modes such a pooler needs (it cannot keep prepared statements): consumers in
// every mode and a batch handler, two consumers racing on the same keys, httpidem in
// both modes with concurrent requests on one key, the Dispatcher (its LISTEN, which
// a transaction pool does not serve, on a direct connection: ListenConnConfig), the
// migrations and the operator API. Every key commits once, every effect is sent
// once.
func TestBehindPgBouncer(t *testing.T) {
	t.Parallel()
	url := os.Getenv("PGBOUNCER_URL")
	if url == "" {
		t.Log("PGBOUNCER_URL is not set: no run through PgBouncer (scripts/services start sets it)")
		return
	}
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
		t.Run(strings.ReplaceAll(mode.String(), " ", "_"), func(t *testing.T) {
			t.Parallel()
			testBehindPgBouncer(t, url, mode)
		})
	}
}

func testBehindPgBouncer(t *testing.T, url string, mode pgx.QueryExecMode) {
	ctx := context.Background()
	direct, schema := pgtest.Setup(t)
	biz := pgx.Identifier{schema, "biz"}.Sanitize()
	_, err := direct.Exec(ctx, `CREATE TABLE `+biz+` (key text PRIMARY KEY, n int NOT NULL DEFAULT 1)`)
	require.NoError(t, err)

	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err, "PGBOUNCER_URL %s", redact.DSN(url))
	cfg.ConnConfig.DefaultQueryExecMode = mode
	cfg.ConnConfig.RuntimeParams["application_name"] = "idem-test:" + schema
	cfg.MaxConns = 12
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)

	write := func(ctx context.Context, tx pgx.Tx, m *message.Message) error {
		if _, err := tx.Exec(ctx, `INSERT INTO `+biz+` (key) VALUES ($1)`, m.UUID); err != nil {
			return err // a second commit of a key would fail here: key is unique
		}
		_, err := effects.Enqueue(m.Context(), tx, effects.Effect{Kind: "mail", Key: "receipt:" + m.UUID, Payload: []byte{0, 0xff, '\\'}})
		return err
	}
	var keys []string
	for _, cm := range []consumer.Mode{consumer.Transactional, consumer.GroupCommit, consumer.Lease} {
		// Two consumers (two processes, say) get the same ten keys at once.
		var hs []message.HandlerFunc
		for range 2 {
			c, err := consumer.New(consumer.Config{Name: "orders-" + cm.String(), Pool: pool, Schema: schema, Mode: cm,
				Batch: batchWait(cm, 20*time.Millisecond), LockTimeout: 10 * time.Second, BusyDelay: 5 * time.Millisecond})
			require.NoError(t, err)
			t.Cleanup(func() { _ = c.Close() })
			hs = append(hs, c.Middleware(func(m *message.Message) ([]*message.Message, error) {
				return nil, write(m.Context(), consumer.Tx(m.Context()), m)
			}))
		}
		var wg sync.WaitGroup
		for i := range 10 {
			key := fmt.Sprintf("%s-%d", cm, i)
			keys = append(keys, key)
			for _, h := range hs {
				wg.Go(func() {
					for attempt := 0; ; attempt++ {
						_, err := h(message.NewMessage(key, []byte(`{}`)))
						if err == nil {
							return
						}
						// A busy key (the other consumer has it) is nacked: deliver again.
						if attempt > 50 || !errors.Is(err, consumer.ErrBusy) {
							t.Errorf("%s: %v", key, err)
							return
						}
					}
				})
			}
		}
		wg.Wait()
	}
	c, err := consumer.New(consumer.Config{Name: "orders-batch", Pool: pool, Schema: schema, Batch: consumer.BatchConfig{MaxWait: 20 * time.Millisecond}})
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	hb := c.HandleBatch(func(ctx context.Context, tx pgx.Tx, msgs []*message.Message) error {
		for _, m := range msgs {
			if err := write(ctx, tx, m); err != nil {
				return err
			}
		}
		return nil
	})
	for _, k := range []string{"batch-1", "batch-2", "batch-1"} {
		require.NoError(t, hb(message.NewMessage(k, []byte(`{}`))))
	}
	keys = append(keys, "batch-1", "batch-2")
	require.Equal(t, len(keys), pgtest.Count(t, direct, `SELECT count(*) FROM `+biz))

	// httpidem: eight concurrent requests with one key, in each mode.
	mw, err := httpidem.New(httpidem.Config{Pool: pool, Schema: schema, Unscoped: true, LockTimeout: 10 * time.Second})
	require.NoError(t, err)
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := "http" + r.URL.Path + "-" + r.Header.Get("Idempotency-Key")
		if tx, err := httpidem.TxSafely(r.Context()); err == nil {
			if _, err := tx.Exec(r.Context(), `INSERT INTO `+biz+` (key) VALUES ($1)`, key); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
		} else if _, err := pool.Exec(r.Context(), `INSERT INTO `+biz+` (key) VALUES ($1)`, key); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, key+"\n")
	})
	mux := http.NewServeMux()
	mux.Handle("POST /payments", mw.Middleware(handler))
	mux.Handle("POST /refunds", mw.Route(httpidem.Route{Lease: true})(handler))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	for _, path := range []string{"/payments", "/refunds"} {
		var wg sync.WaitGroup
		bodies := make([]string, 8)
		for i := range bodies {
			wg.Go(func() {
				for {
					req, _ := http.NewRequest(http.MethodPost, srv.URL+path, strings.NewReader(`{}`))
					req.Header.Set("Idempotency-Key", "k")
					resp, err := srv.Client().Do(req)
					if err != nil {
						t.Error(err)
						return
					}
					body, _ := io.ReadAll(resp.Body)
					_ = resp.Body.Close()
					if resp.StatusCode == http.StatusConflict {
						time.Sleep(20 * time.Millisecond) // still running: retry, as a client does
						continue
					}
					if resp.StatusCode != http.StatusCreated {
						t.Errorf("%s: %d %s", path, resp.StatusCode, body)
					}
					bodies[i] = string(body)
					return
				}
			})
		}
		wg.Wait()
		for _, b := range bodies {
			require.Equal(t, "http"+path+"-k\n", b, "one answer for the key, replayed byte for byte")
		}
		require.Equal(t, 1, pgtest.Count(t, direct, `SELECT count(*) FROM `+biz+` WHERE key = $1`, "http"+path+"-k"))
	}

	// The Dispatcher sends every effect once. Its claims and sends go through the
	// pooler; its LISTEN, which a transaction pool does not serve, goes to Postgres
	// directly, so new effects are sent at once even with an hour between polls.
	var mu sync.Mutex
	sent := map[string]int{}
	d, err := effects.NewDispatcher(effects.Config{Pool: pool, Schema: schema, PollInterval: time.Hour,
		ListenConnConfig: direct.Config().ConnConfig,
		Senders: map[string]effects.Sender{"mail": effects.SenderFunc(func(_ context.Context, e effects.Delivery) error {
			if string(e.Payload) != "\x00\xff\\" {
				return effects.Permanent(fmt.Errorf("payload %x", e.Payload))
			}
			mu.Lock()
			sent[e.Key]++
			mu.Unlock()
			return nil
		})}})
	require.NoError(t, err)
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- d.Run(runCtx) }()
	pgtest.WaitFor(t, 30*time.Second, "every effect done", func() bool {
		return pgtest.Count(t, direct, `SELECT count(*) FROM effects WHERE state = 'done'`) == len(keys)
	})
	require.NoError(t, hb(message.NewMessage("after-start", []byte(`{}`))))
	keys = append(keys, "after-start")
	pgtest.WaitFor(t, 30*time.Second, "woken by NOTIFY through the direct LISTEN connection", func() bool {
		return pgtest.Count(t, direct, `SELECT count(*) FROM effects WHERE state = 'done'`) == len(keys)
	})
	stop()
	require.NoError(t, <-done)
	mu.Lock()
	require.Len(t, sent, len(keys))
	for k, n := range sent {
		require.Equal(t, 1, n, k)
	}
	mu.Unlock()

	// The migrations apply through the pooler too (their lock is transaction-scoped).
	fresh := pgtest.NewSchemaName()
	t.Cleanup(func() { pgtest.DropSchema(t, fresh) })
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: fresh})
	require.NoError(t, err)
	applied, err := m.Up(ctx)
	require.NoError(t, err)
	require.Len(t, applied, len(migrate.Migrations()))

	a, err := admin.New(admin.Config{Pool: pool, Schema: schema})
	require.NoError(t, err)
	st, err := a.Stats(ctx)
	require.NoError(t, err)
	require.Len(t, st.Consumers, 6, "three modes, the batch handler, two HTTP operations")
}
