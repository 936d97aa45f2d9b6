package effects_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/pgtest"
)

// TestMain runs a child role of the multi-process tests in a child process, and
// otherwise the tests, checking for leaked goroutines.
func TestMain(m *testing.M) {
	childproc.Main(childRoles)
	goleak.VerifyTestMain(m)
}

// setup gives a test its own schema and a small pool on it.
func setup(t testing.TB) (*pgxpool.Pool, string) {
	t.Helper()
	return pgtest.Setup(t, pgtest.Options{MaxConns: 4})
}

// start runs a Dispatcher until the test ends (or until the returned stop is
// called), and checks that Run returned nil.
func start(t testing.TB, cfg effects.Config) (stop func()) {
	t.Helper()
	d, err := effects.NewDispatcher(cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("Run: %v", err)
				}
			case <-time.After(30 * time.Second):
				t.Errorf("Run did not return within 30s of its context ending")
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

// fastConfig is a Config for tests: short poll and backoff.
func fastConfig(pool *pgxpool.Pool, schema string, senders map[string]effects.Sender) effects.Config {
	return effects.Config{
		Pool:         pool,
		Schema:       schema,
		Senders:      senders,
		PollInterval: 50 * time.Millisecond,
		Lease:        10 * time.Second,
		Backoff:      effects.Backoff{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond},
		Logger:       slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
	}
}

func enqueue(t testing.TB, pool *pgxpool.Pool, schema string, es ...effects.Effect) {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	for _, e := range es {
		_, err := effects.Enqueue(effects.WithScope(ctx, effects.Scope{Schema: schema}), tx, e)
		require.NoError(t, err)
	}
	require.NoError(t, tx.Commit(ctx))
}

// enqueueMany inserts n effects of kind with keys prefix0..prefix(n-1) in one
// statement.
func enqueueMany(t testing.TB, pool *pgxpool.Pool, kind, prefix string, n int) {
	t.Helper()
	_, err := pool.Exec(context.Background(), `INSERT INTO effects (kind, key, payload, fingerprint)
		SELECT $1, $2 || g, ''::bytea, sha256(''::bytea) FROM generate_series(0, $3 - 1) g`, kind, prefix, n)
	require.NoError(t, err)
}

type effectRow struct {
	State     string
	Attempts  int
	InFlight  bool
	LastError string
	DueIn     time.Duration // next_attempt_at - now()
	Fence     int64
}

func getEffect(t testing.TB, pool *pgxpool.Pool, kind, key string) effectRow {
	t.Helper()
	var r effectRow
	var lastErr *string
	var dueIn float64
	err := pool.QueryRow(context.Background(), `SELECT state, attempts, in_flight, last_error,
			extract(epoch FROM next_attempt_at - now())::float8, fence
		FROM effects WHERE kind = $1 AND key = $2`, kind, key).
		Scan(&r.State, &r.Attempts, &r.InFlight, &lastErr, &dueIn, &r.Fence)
	require.NoError(t, err)
	if lastErr != nil {
		r.LastError = *lastErr
	}
	r.DueIn = time.Duration(dueIn * float64(time.Second))
	return r
}

func countState(t testing.TB, pool *pgxpool.Pool, state string) int {
	return pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE state = $1`, state)
}

func waitState(t testing.TB, pool *pgxpool.Pool, kind, key, state string, timeout time.Duration) effectRow {
	t.Helper()
	var r effectRow
	pgtest.WaitFor(t, timeout, fmt.Sprintf("%s/%s to be %s", kind, key, state), func() bool {
		r = getEffect(t, pool, kind, key)
		return r.State == state
	})
	return r
}
