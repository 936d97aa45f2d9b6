package effects_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/pgtest"
)

// The multi-process tests re-execute the test binary; TestMain sees childRoleEnv
// and runs runChild instead of the tests.
const (
	childRoleEnv     = "IDEM_EFFECTS_TEST_CHILD"
	childSchemaEnv   = "IDEM_EFFECTS_TEST_SCHEMA"
	childMarkerEnv   = "IDEM_EFFECTS_TEST_MARKER"
	childReceiverEnv = "IDEM_EFFECTS_TEST_RECEIVER"
)

// Child roles.
const (
	// roleBlock: a dispatcher whose "mail" sender hands the effect to the receiver
	// (the received table), writes the marker file, then hangs until it is killed.
	roleBlock = "block"
	// roleWorker: a dispatcher whose "notify" sender POSTs the key to the HTTP
	// receiver.
	roleWorker = "worker"
)

const childLease = 2 * time.Second

func runChild(role string) int {
	schema := os.Getenv(childSchemaEnv)
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	cfg.MaxConns = 1
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.ConnConfig.RuntimeParams["application_name"] = "idem-test:" + schema
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer pool.Close()

	dcfg := effects.Config{Pool: pool, Schema: schema, Lease: childLease, PollInterval: 100 * time.Millisecond,
		Backoff: effects.Backoff{Initial: 10 * time.Millisecond, Max: 100 * time.Millisecond}}
	switch role {
	case roleBlock:
		marker := os.Getenv(childMarkerEnv)
		dcfg.Senders = map[string]effects.Sender{"mail": effects.SenderFunc(func(ctx context.Context, d effects.Delivery) error {
			if err := receive(ctx, pool, d.Key); err != nil {
				return err
			}
			if err := os.WriteFile(marker, []byte(d.Key), 0o600); err != nil {
				return err
			}
			select {} // hang mid-send until SIGKILL
		})}
	case roleWorker:
		url := os.Getenv(childReceiverEnv)
		client := &http.Client{}
		dcfg.Concurrency = map[string]int{"notify": 8}
		dcfg.Senders = map[string]effects.Sender{"notify": effects.SenderFunc(func(ctx context.Context, d effects.Delivery) error {
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(d.Key))
			if err != nil {
				return err
			}
			resp, err := client.Do(req)
			if err != nil {
				return err
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusNoContent {
				return fmt.Errorf("receiver: %s", resp.Status)
			}
			return nil
		})}
	default:
		fmt.Fprintln(os.Stderr, "unknown child role", role)
		return 2
	}
	d, err := effects.NewDispatcher(dcfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if err := d.Run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

// receive is the receiving end of the "mail" effects: it counts each key.
func receive(ctx context.Context, db effects.Execer, key string) error {
	_, err := db.Exec(ctx, `INSERT INTO received (key, n) VALUES ($1, 1)
		ON CONFLICT (key) DO UPDATE SET n = received.n + 1`, key)
	return err
}

func createReceived(t testing.TB, pool *pgxpool.Pool) {
	t.Helper()
	_, err := pool.Exec(context.Background(), `CREATE TABLE received (key text PRIMARY KEY, n int NOT NULL)`)
	require.NoError(t, err)
}

// startChild runs the test binary as a dispatcher process in role.
func startChild(t testing.TB, role, schema string, env ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childRoleEnv+"="+role, childSchemaEnv+"="+schema)
	cmd.Env = append(cmd.Env, env...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
		if t.Failed() && out.Len() > 0 {
			t.Logf("child %s (pid %d) output:\n%s", role, cmd.Process.Pid, out.String())
		}
	})
	return cmd
}

// killMidSend starts a dispatcher process, waits until its sender has handed
// "order:1" to the receiver and hangs, and kills it with SIGKILL.
func killMidSend(t *testing.T) (*pgxpool.Pool, string) {
	pool, schema := setup(t)
	createReceived(t, pool)
	enqueue(t, pool, schema, effects.Effect{Kind: "mail", Key: "order:1", Payload: []byte(`{"to":"a@example.com"}`)})
	marker := filepath.Join(t.TempDir(), "sent")
	child := startChild(t, roleBlock, schema, childMarkerEnv+"="+marker)
	waitFor(t, 20*time.Second, "the child to send", func() bool {
		_, err := os.Stat(marker)
		return err == nil
	})
	require.NoError(t, child.Process.Signal(syscall.SIGKILL))
	err := child.Wait()
	var exit *exec.ExitError
	require.True(t, errors.As(err, &exit), "child ended by the kill: %v", err)
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
