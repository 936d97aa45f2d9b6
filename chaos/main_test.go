package chaos_test

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/idemkit/idem/internal/childproc"
)

// TestMain runs a worker's role in a child process (child_test.go), and otherwise
// the tests, checking for leaked goroutines.
func TestMain(m *testing.M) {
	childproc.Main(childRoles)
	goleak.VerifyTestMain(m,
		// Watermill's in-memory deduplicator repository (the peer) starts a
		// cleanup goroutine that nothing can stop.
		goleak.IgnoreTopFunction("github.com/ThreeDotsLabs/watermill/message/router/middleware.(*mapExpiringKeyRepository).cleanOutLoop"),
	)
}
