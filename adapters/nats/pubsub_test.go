package nats_test

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	idemnats "github.com/idemkit/idem/adapters/nats"
)

// TestPubSub runs Watermill's universal suite. The Features are what the
// adapter does: one durable per consumer group, messages kept across
// subscriber instances, no exactly-once and no order (Concurrency 8, and a
// nacked message comes back later). Subscribers of one group share a durable,
// so a new subscriber does not get the messages its group has acked.
func TestPubSub(t *testing.T) {
	forEachServer(t, func(t *testing.T, url string) {
		prefix := namespace(t, url)
		topo := topology(prefix)

		newPubSub := func(t *testing.T, durable string) (message.Publisher, message.Subscriber) {
			nc := connect(t, url)
			pub, err := idemnats.NewPublisher(nc, idemnats.PublisherConfig{Topology: topo})
			require.NoError(t, err)
			sub, err := idemnats.NewSubscriber(nc, idemnats.SubscriberConfig{
				Topology: topo,
				Durable:  durable,
				// The suite nacks some messages hundreds of times and waits 15s at
				// most for the next one, so nacks come back fast and without limit.
				NakDelay: func(uint64) time.Duration { return 20 * time.Millisecond },
				Consumer: jetstream.ConsumerConfig{MaxDeliver: -1},
				// On nats-server 2.9, Close lets the last pull run out; the suite
				// closes 50 subscribers one after another.
				PullExpiry: 200 * time.Millisecond,
			})
			require.NoError(t, err)
			return pub, sub
		}

		tests.TestPubSub(t,
			tests.Features{
				ConsumerGroups:                      true,
				ExactlyOnceDelivery:                 false,
				GuaranteedOrder:                     false,
				GuaranteedOrderWithSingleSubscriber: false,
				Persistent:                          true,
				NewSubscriberReceivesOldMessages:    false,
				ContextPreserved:                    false,
			},
			func(t *testing.T) (message.Publisher, message.Subscriber) { return newPubSub(t, "watermill") },
			newPubSub,
		)
	})
}
