package effects_test

import (
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/pgtest"
)

// TestDispatcherFourProcesses: 10,000 effects across 4 dispatcher processes, one of
// them SIGKILLed halfway and replaced. Every key ends done and reaches the receiver;
// a key reaches it twice only if the killed process held its claim.
func TestDispatcherFourProcesses(t *testing.T) {
	t.Parallel()
	const n = 10_000
	pool, schema := setup(t)
	rc := &receiver{seen: map[string]int{}}
	srv := httptest.NewServer(rc)
	defer srv.Close()
	enqueueMany(t, pool, "notify", "n", n)

	worker := childproc.Options{Params: childproc.Params{"schema": schema, "receiver": srv.URL}}
	children := []*childproc.Child{}
	for range 4 {
		children = append(children, childproc.Start(t, roleWorker, worker))
	}
	pgtest.WaitFor(t, 60*time.Second, "a quarter of the keys received", func() bool {
		d, _ := rc.stats()
		return d >= n/4
	})
	_, dupesBeforeKill := rc.stats()
	require.Empty(t, dupesBeforeKill, "no key is received twice before a kill")
	children[0].KillAndWait(t)
	children[0] = childproc.Start(t, roleWorker, worker)

	pgtest.WaitFor(t, 90*time.Second, "every effect done", func() bool { return countState(t, pool, "done") == n })
	for _, c := range children {
		c.Stop(t, 30*time.Second) // a graceful exit on SIGTERM
	}
	distinct, dupes := rc.stats()
	require.Equal(t, n, distinct, "every key reached the receiver")
	t.Logf("keys received more than once (all after the kill): %d %v", len(dupes), dupes)
	// The killed process held at most Concurrency + min(Concurrency, BatchSize) = 16
	// claims; only those can have been sent and not recorded.
	require.LessOrEqual(t, len(dupes), 16)
	require.Equal(t, 0, countState(t, pool, "pending"))
}
