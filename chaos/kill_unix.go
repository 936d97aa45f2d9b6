//go:build unix

package chaos

import (
	"fmt"
	"os"
	"syscall"
	"time"
)

// killSelf sends SIGKILL to the process itself: no deferred function, no flush of
// buffered output, no graceful close; the same death as an OOM kill or kill -9.
func killSelf(point CrashPoint) {
	fmt.Fprintf(os.Stderr, "chaos: crash point %s fired; sending SIGKILL to pid %d\n", point, os.Getpid())
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	// The signal is delivered asynchronously; never run on past the point.
	for {
		time.Sleep(time.Hour)
	}
}
