package kafka_test

import (
	"testing"

	"go.uber.org/goleak"
)

// Every goroutine the Publisher, the Subscriber and kfake start must be gone
// once they are closed, with one exception in kfake itself: a cluster closed
// while a control function slept (SleepControl, in the slow-metadata tests) can
// leave its run loop blocked handing the slept control back. That goroutine is
// the fake broker's, never ours.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		goleak.IgnoreAnyFunction("github.com/twmb/franz-go/pkg/kfake.(*Cluster).continueSleptControl"))
}
