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
// back. That goroutine is the fake broker's, never ours. The other is Watermill's
// universal suite's: the multiplier that TestPublishSubscribeInOrder subscribes
// through forwards each message to a channel the test stops reading once it has
// what it counts, so a message still in flight at that moment leaves the
// multiplier's forwarding goroutine (and the one waiting for it) blocked for good,
// however the Subscriber closes. Seen on a loaded machine only.
func TestMain(m *testing.M) {
	childproc.Main(map[string]childproc.Role{"subscriber": subscriberChild})
	goleak.VerifyTestMain(m,
		goleak.IgnoreAnyFunction("github.com/twmb/franz-go/pkg/kfake.(*Cluster).continueSleptControl"),
		goleak.IgnoreAnyFunction("github.com/ThreeDotsLabs/watermill/internal/subscriber.(*multiplier).Subscribe.func2"),
		goleak.IgnoreAnyFunction("github.com/ThreeDotsLabs/watermill/internal/subscriber.(*multiplier).Subscribe.func3"))
}
