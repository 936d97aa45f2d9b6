package pgtest

import (
	"testing"
	"time"
)

// WaitInterval is how often WaitFor checks its condition.
const WaitInterval = 10 * time.Millisecond

// WaitFor checks cond every WaitInterval, first at once, until it holds, and fails
// the test if it does not within timeout, saying it was waiting for what. cond
// runs on the caller's goroutine, so it may fail the test itself (Count does).
func WaitFor(tb testing.TB, timeout time.Duration, what string, cond func() bool) {
	tb.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			tb.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(WaitInterval)
	}
}
