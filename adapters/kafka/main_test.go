package kafka_test

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/idemkit/idem/internal/childproc"
)

// TestMain runs the subscriber process of TestSubscriberKilled in a child
// process, and otherwise the tests. Every goroutine the Publisher, the Subscriber
// and kfake start must be gone once they are closed, with one exception in kfake
// itself: a cluster closed while a control function slept (SleepControl, in the
// slow-metadata tests) can leave its run loop blocked handing the slept control
// back. That goroutine is the fake broker's, never ours.
func TestMain(m *testing.M) {
	childproc.Main(map[string]childproc.Role{"subscriber": subscriberChild})
	goleak.VerifyTestMain(m,
		goleak.IgnoreAnyFunction("github.com/twmb/franz-go/pkg/kfake.(*Cluster).continueSleptControl"))
}
