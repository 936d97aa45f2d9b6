package effects_test

import (
	"net/http/httptest"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
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

	env := childReceiverEnv + "=" + srv.URL
	children := []*exec.Cmd{}
	for range 4 {
		children = append(children, startChild(t, roleWorker, schema, env))
	}
	waitFor(t, 60*time.Second, "a quarter of the keys received", func() bool {
		d, _ := rc.stats()
		return d >= n/4
	})
	_, dupesBeforeKill := rc.stats()
	require.Empty(t, dupesBeforeKill, "no key is received twice before a kill")
	require.NoError(t, children[0].Process.Signal(syscall.SIGKILL))
	_ = children[0].Wait()
	children[0] = startChild(t, roleWorker, schema, env)

	waitFor(t, 90*time.Second, "every effect done", func() bool { return countState(t, pool, "done") == n })
	for _, c := range children {
		require.NoError(t, c.Process.Signal(syscall.SIGTERM))
		require.NoError(t, c.Wait(), "graceful exit on SIGTERM")
	}
	distinct, dupes := rc.stats()
	require.Equal(t, n, distinct, "every key reached the receiver")
	t.Logf("keys received more than once (all after the kill): %d %v", len(dupes), dupes)
	// The killed process held at most Concurrency + min(Concurrency, BatchSize) = 16
	// claims; only those can have been sent and not recorded.
	require.LessOrEqual(t, len(dupes), 16)
	require.Equal(t, 0, countState(t, pool, "pending"))
}
