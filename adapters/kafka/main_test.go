package kafka_test

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/idemkit/idem/internal/childproc"
)

// TestMain runs the subscriber process of TestSubscriberKilled in a child
// process, and otherwise the tests: every goroutine the Publisher, the Subscriber
// and kfake start must be gone once they are closed.
func TestMain(m *testing.M) {
	childproc.Main(map[string]childproc.Role{"subscriber": subscriberChild})
	goleak.VerifyTestMain(m)
}
