package kafka_test

import (
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"

	"github.com/idemkit/idem/adapters/kafka"
)

// Order holds per partition, and the suite's publisher keys records by
// payload, so messages of one payload type share a partition: that is what
// the in-order test checks. Duplicates are possible (ExactlyOnceDelivery is
// false): after a rebalance the new owner redelivers what was not committed.
func universalFeatures() tests.Features {
	return tests.Features{
		ConsumerGroups:      true,
		ExactlyOnceDelivery: false,
		GuaranteedOrder:     true,
		Persistent:          true,
		// A new member of an existing group continues from the group's
		// offsets; only a new group (or a groupless Subscriber) reads old
		// messages, and the suite's constructor keeps one group per test.
		NewSubscriberReceivesOldMessages: false,
	}
}

const universalPartitions = 4

func byPayload(_ string, msg *message.Message) ([]byte, error) { return msg.Payload, nil }

func runUniversal(t *testing.T, brokers []string) {
	// TestPublishSubscribeInOrder closes its multiplied subscriber before it
	// subscribes (`defer require.NoError(t, sub.Close())` evaluates Close at
	// once), so the suite never closes those. Close every subscriber the
	// constructors made once the suite is done, so that goleak stays useful.
	var mu sync.Mutex
	var subs []*kafka.Subscriber
	t.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		for _, s := range subs {
			_ = s.Close()
		}
	})
	newSub := func(t *testing.T, group string) *kafka.Subscriber {
		s := newSubscriber(t, subscriberConfig(brokers, group, universalPartitions))
		mu.Lock()
		subs = append(subs, s)
		mu.Unlock()
		return s
	}

	tests.TestPubSub(t, universalFeatures(),
		func(t *testing.T) (message.Publisher, message.Subscriber) {
			// One group per suite test: the tests that re-create the
			// subscriber expect it to continue where the last one stopped.
			return newPublisher(t, brokers, byPayload), newSub(t, "universal-"+sanitize(t.Name()))
		},
		func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
			return newPublisher(t, brokers, byPayload), newSub(t, group)
		},
	)
}

// TestUniversal runs Watermill's suite against kfake, and also against the
// brokers in KAFKA_BROKERS when that is set (subtest "external=host:port").
func TestUniversal(t *testing.T) {
	forEachBroker(t, runUniversal)
}

var _ kafka.PartitionKeyFunc = byPayload

func sanitize(s string) string {
	b := []byte(s)
	for i, c := range b {
		if c == '/' || c == ' ' {
			b[i] = '_'
		}
	}
	return string(b)
}
