package chaos_test

import (
	"os"
	"testing"

	"go.uber.org/goleak"
)

// envChild names the role of a re-executed test binary (see child_test.go).
const envChild = "IDEM_CHAOS_TEST_CHILD"

func TestMain(m *testing.M) {
	if role := os.Getenv(envChild); role != "" {
		os.Exit(runChild(role))
	}
	goleak.VerifyTestMain(m,
		// Watermill's in-memory deduplicator repository (the peer) starts a
		// cleanup goroutine that nothing can stop.
		goleak.IgnoreTopFunction("github.com/ThreeDotsLabs/watermill/message/router/middleware.(*mapExpiringKeyRepository).cleanOutLoop"),
	)
}
