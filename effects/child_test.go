package effects_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/pgtest"
)

// The multi-process tests run this test binary again as dispatcher processes
// (internal/childproc), in one of these roles, on the parent's schema.
var childRoles = map[string]childproc.Role{
	// block: a dispatcher whose "mail" sender hands the effect to the receiver
	// (the received table), writes the marker file, then hangs until it is killed.
	roleBlock: func(ctx context.Context, p childproc.Params) error {
		return runDispatcherChild(ctx, p["schema"], func(pool *pgxpool.Pool, cfg *effects.Config) {
			cfg.Senders = map[string]effects.Sender{"mail": effects.SenderFunc(func(ctx context.Context, d effects.Delivery) error {
				if err := receive(ctx, pool, d.Key); err != nil {
					return err
				}
				if err := os.WriteFile(p["marker"], []byte(d.Key), 0o600); err != nil {
					return err
				}
				select {} // hang mid-send until SIGKILL
			})}
		})
	},
	// worker: a dispatcher whose "notify" sender POSTs the key to the HTTP receiver.
	roleWorker: func(ctx context.Context, p childproc.Params) error {
		client := &http.Client{}
		return runDispatcherChild(ctx, p["schema"], func(_ *pgxpool.Pool, cfg *effects.Config) {
			cfg.Concurrency = map[string]int{"notify": 8}
			cfg.Senders = map[string]effects.Sender{"notify": effects.SenderFunc(func(ctx context.Context, d effects.Delivery) error {
				req, err := http.NewRequestWithContext(ctx, http.MethodPost, p["receiver"], strings.NewReader(d.Key))
				if err != nil {
					return err
				}
				resp, err := client.Do(req)
				if err != nil {
					return err
				}
				_ = resp.Body.Close()
				if resp.StatusCode != http.StatusNoContent {
					return fmt.Errorf("receiver: %s", resp.Status)
				}
				return nil
			})}
		})
	},
}

const (
	roleBlock  = "block"
	roleWorker = "worker"
)

const childLease = 2 * time.Second

// runDispatcherChild runs a Dispatcher on schema, with the senders that withSenders
// sets, until ctx ends.
func runDispatcherChild(ctx context.Context, schema string, withSenders func(*pgxpool.Pool, *effects.Config)) error {
	pcfg, err := pgtest.ConfigFor(schema, pgtest.Options{MaxConns: 1})
	if err != nil {
		return err
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	cfg := effects.Config{Pool: pool, Schema: schema, Lease: childLease, PollInterval: 100 * time.Millisecond,
		Backoff: effects.Backoff{Initial: 10 * time.Millisecond, Max: 100 * time.Millisecond}}
	withSenders(pool, &cfg)
	d, err := effects.NewDispatcher(cfg)
	if err != nil {
		return err
	}
	return d.Run(ctx)
}

// receive is the receiving end of the "mail" effects: it counts each key.
func receive(ctx context.Context, db *pgxpool.Pool, key string) error {
	_, err := db.Exec(ctx, `INSERT INTO received (key, n) VALUES ($1, 1)
		ON CONFLICT (key) DO UPDATE SET n = received.n + 1`, key)
	return err
}

func createReceived(t testing.TB, pool *pgxpool.Pool) {
	t.Helper()
	_, err := pool.Exec(context.Background(), `CREATE TABLE received (key text PRIMARY KEY, n int NOT NULL)`)
	require.NoError(t, err)
}

// killMidSend starts a dispatcher process, waits until its sender has handed
// "order:1" to the receiver and hangs, and kills it with SIGKILL.
func killMidSend(t *testing.T) (*pgxpool.Pool, string) {
	pool, schema := setup(t)
	createReceived(t, pool)
	enqueue(t, pool, schema, effects.Effect{Kind: "mail", Key: "order:1", Payload: []byte(`{"to":"a@example.com"}`)})
	marker := filepath.Join(t.TempDir(), "sent")
	child := childproc.Start(t, roleBlock, childproc.Options{Params: childproc.Params{"schema": schema, "marker": marker}})
	pgtest.WaitFor(t, 20*time.Second, "the child to send", func() bool {
		_, err := os.Stat(marker)
		return err == nil
	})
	child.KillAndWait(t)
	r := getEffect(t, pool, "mail", "order:1")
	require.Equal(t, "pending", r.State)
	require.True(t, r.InFlight, "the killed claim is still marked in flight")
	require.Equal(t, 1, r.Attempts)
	return pool, schema
}

// TestDispatcherProcessKilledMidSend: the effect is sent again after the lease,
// with the same key, and ends done.
func TestDispatcherProcessKilledMidSend(t *testing.T) {
	t.Parallel()
	pool, schema := killMidSend(t)
	killedAt := time.Now()
	rec := newRecorder(func(ctx context.Context, d effects.Delivery) error { return receive(ctx, pool, d.Key) })
	start(t, fastConfig(pool, schema, map[string]effects.Sender{"mail": rec}))
	r := waitState(t, pool, "mail", "order:1", "done", 20*time.Second)
	require.Equal(t, 2, r.Attempts)
	require.Equal(t, []int{2}, rec.attempts("order:1"), "sent again once, as attempt 2")
	require.Equal(t, "order:1", rec.sends["order:1"][0].Key)
	require.Greater(t, time.Since(killedAt), childLease/4, "not before the lease ran out")
	require.Equal(t, 2, pgtest.Count(t, pool, `SELECT n FROM received WHERE key = 'order:1'`),
		"the receiver saw the key twice: without a Reconciler, it must honour the key")
}

// TestDispatcherProcessKilledMidSendReconciled: a Reconciler finds that the killed
// attempt took effect, so the effect is not sent a second time.
func TestDispatcherProcessKilledMidSendReconciled(t *testing.T) {
	t.Parallel()
	pool, schema := killMidSend(t)
	sender := &reconcilingSender{
		send: func(ctx context.Context, d effects.Delivery) error { return receive(ctx, pool, d.Key) },
		reconcile: func(ctx context.Context, d effects.Delivery) (bool, error) {
			var n int
			err := pool.QueryRow(ctx, `SELECT count(*) FROM received WHERE key = $1`, d.Key).Scan(&n)
			return n > 0, err
		},
	}
	start(t, fastConfig(pool, schema, map[string]effects.Sender{"mail": sender}))
	waitState(t, pool, "mail", "order:1", "done", 20*time.Second)
	require.EqualValues(t, 1, sender.reconciles.Load())
	require.EqualValues(t, 0, sender.sends.Load())
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT n FROM received WHERE key = 'order:1'`))
}

// receiver is an HTTP endpoint that counts each key it is sent.
type receiver struct {
	mu   sync.Mutex
	seen map[string]int
}

func (rc *receiver) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	rc.mu.Lock()
	rc.seen[string(b)]++
	rc.mu.Unlock()
	w.WriteHeader(http.StatusNoContent)
}

func (rc *receiver) stats() (distinct int, dupes []string) {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	for k, n := range rc.seen {
		if n > 1 {
			dupes = append(dupes, fmt.Sprintf("%s×%d", k, n))
		}
	}
	return len(rc.seen), dupes
}
