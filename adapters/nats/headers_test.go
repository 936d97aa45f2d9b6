package nats_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	idemnats "github.com/idemkit/idem/adapters/nats"
)

// publishWithExpectations stores two messages on b.topic's stream the way an
// optimistic-concurrency producer does: the second carries the whole
// Nats-Expected-* family, all of which hold when it is published. It returns
// the second message's ID.
func publishWithExpectations(t *testing.T, b *testBundle) string {
	t.Helper()
	ctx := context.Background()
	stream, subject := b.topo.StreamName(b.topic), b.topo.Subject(b.topic)
	_, err := b.js.PublishMsg(ctx, &natsgo.Msg{Subject: subject, Data: []byte("first"),
		Header: natsgo.Header{jetstream.MsgIDHeader: {"first"}}})
	require.NoError(t, err)
	_, err = b.js.PublishMsg(ctx, &natsgo.Msg{Subject: subject, Data: []byte("expecting"), Header: natsgo.Header{
		jetstream.MsgIDHeader:                         {"expecting"},
		jetstream.ExpectedStreamHeader:                {stream},
		jetstream.ExpectedLastSeqHeader:               {"1"},
		jetstream.ExpectedLastSubjSeqHeader:           {"1"},
		jetstream.ExpectedLastMsgIDHeader:             {"first"},
		"Nats-Expected-Last-Subject-Sequence-Subject": {subject},
		"trace": {"abc"},
	}})
	require.NoError(t, err, "the expectations hold on the first publish")
	return "expecting"
}

func requireNoDirectives(t *testing.T, msg *message.Message) {
	t.Helper()
	for k := range msg.Metadata {
		assert.False(t, strings.HasPrefix(k, "Nats-Expected-"), "metadata %s survived receipt", k)
	}
	assert.Equal(t, "abc", msg.Metadata.Get("trace"), "ordinary headers stay")
}

// A message published with Nats-Expected-* headers arrives without them, so
// a handler that forwards it (returns it, the common Watermill pattern)
// publishes it to another stream, where the expectations were never meant
// to apply. With them kept, the forward failed: "expected stream does not
// match".
func TestForwardingDropsPublishExpectations(t *testing.T) {
	t.Parallel()
	forEachServer(t, func(t *testing.T, url string) {
		b := setup(t, url)
		sub := b.subscriber(t, idemnats.SubscriberConfig{Concurrency: 1}) // in stream order
		require.NoError(t, sub.SubscribeInitialize(b.topic))
		id := publishWithExpectations(t, b)

		msgs, err := sub.Subscribe(context.Background(), b.topic)
		require.NoError(t, err)
		receive(t, msgs, 30*time.Second).Ack()
		got := receive(t, msgs, 30*time.Second)
		require.Equal(t, id, got.UUID)
		requireNoDirectives(t, got)

		forward := b.topic + "_fwd"
		require.NoError(t, b.pub.Publish(forward, got), "forwarding a received message")
		got.Ack()

		fwdSub := b.subscriber(t, idemnats.SubscriberConfig{Durable: "fwd"})
		fwd, err := fwdSub.Subscribe(context.Background(), forward)
		require.NoError(t, err)
		m := receive(t, fwd, 30*time.Second)
		assert.Equal(t, id, m.UUID)
		assert.Equal(t, "expecting", string(m.Payload))
		m.Ack()
	})
}

// The same message dead-lettered after MaxDeliver reaches the dead-letter
// stream, by both roads: a nacked last delivery, and the MAX_DELIVERIES
// advisory (which reads the stored message back). With the headers kept, the
// dead-letter publish was refused and the message never got there.
func TestDeadLetterDropsPublishExpectations(t *testing.T) {
	t.Parallel()
	forEachServer(t, func(t *testing.T, url string) {
		for _, road := range []string{idemnats.MaxDeliveredByNack, idemnats.MaxDeliveredByAdvisory} {
			t.Run(road, func(t *testing.T) {
				b := setup(t, url)
				dlq := b.topic + "_dead"
				hookErrs := make(chan error, 4)
				cfg := idemnats.SubscriberConfig{
					Concurrency: 1, // in stream order
					NakDelay:    func(uint64) time.Duration { return 20 * time.Millisecond },
					Consumer:    jetstream.ConsumerConfig{MaxDeliver: 2, AckWait: time.Second},
					OnMaxDeliver: func(ctx context.Context, d idemnats.MaxDelivered) error {
						err := idemnats.PublishDeadLetter(b.pub, dlq)(ctx, d)
						hookErrs <- err
						return err
					},
				}
				if road == idemnats.MaxDeliveredByAdvisory {
					// Two messages held at once by the instance that dies.
					cfg.Concurrency, cfg.Consumer.MaxDeliver = 2, 1
				}
				sub := b.subscriber(t, cfg)
				require.NoError(t, sub.SubscribeInitialize(b.topic))
				id := publishWithExpectations(t, b)

				if road == idemnats.MaxDeliveredByAdvisory {
					// Both messages go to an instance that dies with them.
					cons, err := b.js.Consumer(context.Background(), b.topo.StreamName(b.topic), "test")
					require.NoError(t, err)
					batch, err := cons.Fetch(2, jetstream.FetchMaxWait(2*time.Second))
					require.NoError(t, err)
					for range batch.Messages() {
					}
				}
				msgs, err := sub.Subscribe(context.Background(), b.topic)
				require.NoError(t, err)
				if road == idemnats.MaxDeliveredByNack {
					receive(t, msgs, 30*time.Second).Ack() // "first"
					for i := 1; i <= 2; i++ {
						m := receive(t, msgs, 30*time.Second)
						require.Equal(t, id, m.UUID)
						requireNoDirectives(t, m)
						m.Nack()
					}
				}

				deadSub := b.subscriber(t, idemnats.SubscriberConfig{Durable: "dlq"})
				dead, err := deadSub.Subscribe(context.Background(), dlq)
				require.NoError(t, err)
				want := map[string]bool{id: true}
				if road == idemnats.MaxDeliveredByAdvisory {
					want["first"] = true
				}
				for len(want) > 0 {
					select {
					case err := <-hookErrs:
						require.NoError(t, err, "the dead-letter publish")
					case m := <-dead:
						require.True(t, want[m.UUID], "unexpected dead letter %s", m.UUID)
						delete(want, m.UUID)
						requireNoDirectivesIn(t, m)
						assert.Equal(t, road == idemnats.MaxDeliveredByNack, m.Metadata.Get("dead_letter_deliveries") == "2")
						m.Ack()
					case <-time.After(15 * time.Second):
						t.Fatalf("dead letters still missing: %v", want)
					}
				}
				nothing(t, msgs, 200*time.Millisecond)
			})
		}
	})
}

func requireNoDirectivesIn(t *testing.T, msg *message.Message) {
	t.Helper()
	for k := range msg.Metadata {
		assert.False(t, strings.HasPrefix(k, "Nats-Expected-"), "metadata %s reached the dead-letter stream", k)
	}
}
