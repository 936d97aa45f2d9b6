package nats_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmjetstream "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/jetstream"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	natsgo "github.com/nats-io/nats.go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	idemnats "github.com/idemkit/idem/adapters/nats"
)

// watermillNATS is one way of using Watermill's own NATS adapter
// (watermill-nats v2) with JetStream. Each gets a connection of its own,
// since their Close closes (drains) it.
type watermillNATS struct {
	name string
	pub  func(t *testing.T, url string) message.Publisher
	sub  func(t *testing.T, url string) message.Subscriber
}

var watermillNATSFlavours = []watermillNATS{
	{
		// pkg/jetstream: the JetStream Publisher and Subscriber on nats.go's
		// jetstream API (a beta in watermill-nats).
		name: "pkg/jetstream",
		pub: func(t *testing.T, url string) message.Publisher {
			p, err := wmjetstream.NewPublisher(wmjetstream.PublisherConfig{Conn: dial(t, url), Logger: watermill.NopLogger{}})
			require.NoError(t, err)
			t.Cleanup(func() { _ = p.Close() })
			return p
		},
		sub: func(t *testing.T, url string) message.Subscriber {
			s, err := wmjetstream.NewSubscriber(wmjetstream.SubscriberConfig{Conn: dial(t, url), Logger: watermill.NopLogger{}})
			require.NoError(t, err)
			t.Cleanup(func() { _ = s.Close() })
			return s
		},
	},
	{
		// pkg/nats with JetStream on: the Publisher and Subscriber that
		// watermill-nats recommends for production (JetStreamContext, push
		// consumers).
		name: "pkg/nats",
		pub: func(t *testing.T, url string) message.Publisher {
			p, err := wmnats.NewPublisherWithNatsConn(dial(t, url), wmnats.PublisherPublishConfig{
				Marshaler:         &wmnats.NATSMarshaler{},
				SubjectCalculator: wmnats.DefaultSubjectCalculator,
			}, watermill.NopLogger{})
			require.NoError(t, err)
			t.Cleanup(func() { _ = p.Close() })
			return p
		},
		sub: func(t *testing.T, url string) message.Subscriber {
			s, err := wmnats.NewSubscriberWithNatsConn(dial(t, url), wmnats.SubscriberSubscriptionConfig{
				Unmarshaler:    &wmnats.NATSMarshaler{},
				AckWaitTimeout: 5 * time.Second,
				CloseTimeout:   5 * time.Second,
				JetStream: wmnats.JetStreamConfig{
					SubscribeOptions: []natsgo.SubOpt{natsgo.DeliverAll(), natsgo.AckExplicit()},
				},
			}, watermill.NopLogger{})
			require.NoError(t, err)
			t.Cleanup(func() { _ = s.Close() })
			return s
		},
	},
}

func dial(t *testing.T, url string) *natsgo.Conn {
	t.Helper()
	nc, err := natsgo.Connect(url)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	return nc
}

// interopTopology names stream and subject after the topic, as
// watermill-nats does by default (its JetStream publisher publishes on the
// stream's name), so both adapters find the same stream.
func interopTopology(prefix string) (idemnats.Topology, string) {
	same := func(topic string) string { return topic }
	return idemnats.Topology{StreamName: same, Subject: same, AutoProvision: true}, prefix + "interop"
}

// A message keeps its UUID between idem's NATS adapter and watermill-nats, in
// both directions: idem reads watermill-nats' _watermill_message_uuid header
// when there is no Nats-Msg-Id, and writes both. Before, each side saw the
// other's messages with an empty UUID (or a fresh random one), so switching
// adapters lost deduplication.
func TestWatermillNATSKeepsUUIDs(t *testing.T) {
	t.Parallel()
	forEachServer(t, func(t *testing.T, url string) {
		for _, wm := range watermillNATSFlavours {
			t.Run(wm.name, func(t *testing.T) {
				topo, topic := interopTopology(namespace(t, url))
				nc := connect(t, url)
				pub, err := idemnats.NewPublisher(nc, idemnats.PublisherConfig{Topology: topo})
				require.NoError(t, err)
				defer func() { require.NoError(t, pub.Close()) }()
				sub, err := idemnats.NewSubscriber(nc, idemnats.SubscriberConfig{Topology: topo, Durable: "idem", PullExpiry: 200 * time.Millisecond})
				require.NoError(t, err)
				defer func() { require.NoError(t, sub.Close()) }()
				require.NoError(t, sub.SubscribeInitialize(topic))

				t.Run("watermill-nats to idem", func(t *testing.T) {
					wmPub := wm.pub(t, url)
					sent := message.NewMessage("wm-"+watermill.NewUUID(), []byte("from watermill-nats"))
					sent.Metadata.Set("tenant", "acme")
					// A producer retry: watermill-nats sets no Nats-Msg-Id by
					// default, so the stream stores both, and the consumer's
					// inbox must see one UUID twice to drop the second.
					require.NoError(t, wmPub.Publish(topic, sent))
					require.NoError(t, wmPub.Publish(topic, sent.Copy()))

					ctx, cancel := context.WithCancel(context.Background())
					defer cancel()
					msgs, err := sub.Subscribe(ctx, topic)
					require.NoError(t, err)
					for range 2 {
						got := receive(t, msgs, 30*time.Second)
						assert.Equal(t, sent.UUID, got.UUID)
						assert.Equal(t, "from watermill-nats", string(got.Payload))
						assert.Equal(t, "acme", got.Metadata.Get("tenant"))
						assert.Empty(t, got.Metadata.Get(idemnats.WatermillUUIDHeader), "the UUID header is not metadata")
						got.Ack()
					}
				})

				t.Run("idem to watermill-nats", func(t *testing.T) {
					ctx, cancel := context.WithCancel(context.Background())
					defer cancel()
					msgs, err := wm.sub(t, url).Subscribe(ctx, topic)
					require.NoError(t, err)
					sent := message.NewMessage("idem-"+watermill.NewUUID(), []byte("from idem"))
					sent.Metadata.Set("tenant", "acme")
					require.NoError(t, pub.Publish(topic, sent))

					// The subscriber may also get the earlier subtest's messages.
					deadline := time.After(10 * time.Second)
					for {
						select {
						case got := <-msgs:
							got.Ack()
							if string(got.Payload) != "from idem" {
								continue
							}
							assert.Equal(t, sent.UUID, got.UUID)
							assert.Equal(t, "acme", got.Metadata.Get("tenant"))
							assert.Empty(t, got.Metadata.Get("Nats-Msg-Id"))
							assert.Empty(t, got.Metadata.Get(idemnats.WatermillUUIDHeader))
							return
						case <-deadline:
							t.Fatal("watermill-nats did not receive idem's message")
						}
					}
				})
			})
		}
	})
}
