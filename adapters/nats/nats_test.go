package nats_test

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"cmp"

	idemnats "github.com/idemkit/idem/adapters/nats"
	"github.com/idemkit/idem/internal/pgtest"
)

type testBundle struct {
	url   string
	nc    *natsgo.Conn
	js    jetstream.JetStream
	topo  idemnats.Topology
	topic string
	pub   *idemnats.Publisher
}

func setup(t *testing.T, url string) *testBundle {
	t.Helper()
	b := &testBundle{url: url, topo: topology(namespace(t, url)), topic: newTopic()}
	b.nc = connect(t, url)
	var err error
	b.js, err = jetstream.New(b.nc)
	require.NoError(t, err)
	b.pub, err = idemnats.NewPublisher(b.nc, idemnats.PublisherConfig{Topology: b.topo})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, b.pub.Close()) })
	return b
}

func (b *testBundle) subscriber(t *testing.T, cfg idemnats.SubscriberConfig) *idemnats.Subscriber {
	t.Helper()
	cfg.Topology = b.topo
	cfg.Durable = cmp.Or(cfg.Durable, "test")
	cfg.PullExpiry = cmp.Or(cfg.PullExpiry, 200*time.Millisecond)
	s, err := idemnats.NewSubscriber(b.nc, cfg)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, s.Close()) })
	return s
}

func (b *testBundle) publish(t *testing.T, n int) []*message.Message {
	t.Helper()
	return publishN(t, b.pub, b.topic, n)
}

func publishN(t *testing.T, pub message.Publisher, topic string, n int) []*message.Message {
	t.Helper()
	var msgs []*message.Message
	for i := range n {
		msgs = append(msgs, message.NewMessage(fmt.Sprintf("%s-%d", topic, i), []byte(strconv.Itoa(i))))
	}
	require.NoError(t, pub.Publish(topic, msgs...))
	return msgs
}

func (b *testBundle) streamMsgs(t *testing.T) uint64 {
	t.Helper()
	s, err := b.js.Stream(context.Background(), b.topo.StreamName(b.topic))
	require.NoError(t, err)
	info, err := s.Info(context.Background())
	require.NoError(t, err)
	return info.State.Msgs
}

func receive(t *testing.T, msgs <-chan *message.Message, within time.Duration) *message.Message {
	t.Helper()
	select {
	case m, ok := <-msgs:
		require.True(t, ok, "channel closed")
		return m
	case <-time.After(within):
		t.Fatalf("no message within %s", within)
		return nil
	}
}

func nothing(t *testing.T, msgs <-chan *message.Message, during time.Duration) {
	t.Helper()
	select {
	case m := <-msgs:
		t.Fatalf("unexpected message %s (delivery %s)", m.UUID, m.Metadata.Get(idemnats.MetadataNumDelivered))
	case <-time.After(during):
	}
}

func TestMetadataAndUUIDTravel(t *testing.T) {
	t.Parallel()
	forEachServer(t, func(t *testing.T, url string) {
		b := setup(t, url)
		sub := b.subscriber(t, idemnats.SubscriberConfig{})
		msgs, err := sub.Subscribe(context.Background(), b.topic)
		require.NoError(t, err)

		before := time.Now().Add(-time.Second)
		sent := message.NewMessage("uuid-1", []byte("payload"))
		sent.Metadata.Set("trace", "abc")
		require.NoError(t, b.pub.Publish(b.topic, sent))

		got := receive(t, msgs, 30*time.Second)
		assert.Equal(t, "uuid-1", got.UUID)
		assert.Equal(t, "payload", string(got.Payload))
		assert.Equal(t, "abc", got.Metadata.Get("trace"))
		assert.Equal(t, b.topo.StreamName(b.topic), got.Metadata.Get(idemnats.MetadataStream))
		assert.Equal(t, "test", got.Metadata.Get(idemnats.MetadataConsumer))
		assert.Equal(t, "1", got.Metadata.Get(idemnats.MetadataStreamSeq))
		assert.Equal(t, "1", got.Metadata.Get(idemnats.MetadataNumDelivered))
		assert.Equal(t, b.topo.Subject(b.topic), got.Metadata.Get(idemnats.MetadataSubject))
		ts, err := time.Parse(time.RFC3339Nano, got.Metadata.Get(idemnats.MetadataTimestamp))
		require.NoError(t, err)
		assert.True(t, ts.After(before), "timestamp %s", ts)
		got.Ack()
	})
}

func TestRedeliveryAfterAckWait(t *testing.T) {
	t.Parallel()
	forEachServer(t, func(t *testing.T, url string) {
		b := setup(t, url)
		sub := b.subscriber(t, idemnats.SubscriberConfig{Consumer: jetstream.ConsumerConfig{AckWait: time.Second}})
		require.NoError(t, sub.SubscribeInitialize(b.topic))
		b.publish(t, 1)

		// A crashed instance: it pulls the message and never settles it.
		cons, err := b.js.Consumer(context.Background(), b.topo.StreamName(b.topic), "test")
		require.NoError(t, err)
		batch, err := cons.Fetch(1, jetstream.FetchMaxWait(2*time.Second))
		require.NoError(t, err)
		first := <-batch.Messages()
		require.NotNil(t, first)
		taken := time.Now()

		msgs, err := sub.Subscribe(context.Background(), b.topic)
		require.NoError(t, err)
		got := receive(t, msgs, 30*time.Second)
		assert.GreaterOrEqual(t, time.Since(taken), 900*time.Millisecond, "redelivered before AckWait")
		assert.Equal(t, "2", got.Metadata.Get(idemnats.MetadataNumDelivered))
		got.Ack()
	})
}

func TestLongHandlerKeepsItsMessage(t *testing.T) {
	t.Parallel()
	forEachServer(t, func(t *testing.T, url string) {
		b := setup(t, url)
		sub := b.subscriber(t, idemnats.SubscriberConfig{Consumer: jetstream.ConsumerConfig{AckWait: time.Second}})
		other := b.subscriber(t, idemnats.SubscriberConfig{Consumer: jetstream.ConsumerConfig{AckWait: time.Second}})
		msgs, err := sub.Subscribe(context.Background(), b.topic)
		require.NoError(t, err)
		b.publish(t, 1)

		got := receive(t, msgs, 30*time.Second)
		otherMsgs, err := other.Subscribe(context.Background(), b.topic)
		require.NoError(t, err)
		// Three AckWaits in the handler: InProgress keeps the message here.
		nothing(t, otherMsgs, 3*time.Second)
		got.Ack()
		nothing(t, otherMsgs, 1500*time.Millisecond)
		nothing(t, msgs, 0)
	})
}

func TestNakDelayIsHonoured(t *testing.T) {
	t.Parallel()
	forEachServer(t, func(t *testing.T, url string) {
		b := setup(t, url)
		const delay = 800 * time.Millisecond
		sub := b.subscriber(t, idemnats.SubscriberConfig{NakDelay: func(n uint64) time.Duration { return time.Duration(n) * delay }})
		msgs, err := sub.Subscribe(context.Background(), b.topic)
		require.NoError(t, err)
		b.publish(t, 1)

		// Each nack waits NakDelay of the count the server reported for the nacked
		// delivery: that is the adapter's part. That the count goes up by one is the
		// server's part; the embedded server, the version go.mod pins, is held to
		// it. (The external nats-server 2.9.10 has once reported a redelivery as
		// delivery 1 on a loaded machine; the adapter then waited NakDelay(1), as it
		// should.)
		numDelivered := func(m *message.Message) uint64 {
			n, err := strconv.ParseUint(m.Metadata.Get(idemnats.MetadataNumDelivered), 10, 64)
			require.NoError(t, err)
			return n
		}
		first := receive(t, msgs, 30*time.Second)
		require.EqualValues(t, 1, b.streamMsgs(t), "one message in the stream: every delivery below is of it")
		n1 := numDelivered(first)
		require.EqualValues(t, 1, n1)
		nacked := time.Now()
		first.Nack()
		second := receive(t, msgs, 30*time.Second)
		assert.GreaterOrEqual(t, time.Since(nacked), time.Duration(n1)*delay-50*time.Millisecond)
		n2 := numDelivered(second)
		if url != externalURL() {
			assert.EqualValues(t, 2, n2)
		} else if n2 != n1+1 {
			t.Logf("the external server reported delivery %d after delivery %d", n2, n1)
		}
		nacked = time.Now()
		second.Nack()
		third := receive(t, msgs, 30*time.Second)
		assert.GreaterOrEqual(t, time.Since(nacked), time.Duration(n2)*delay-50*time.Millisecond, "the delay grows with NumDelivered")
		third.Ack()
		assert.Equal(t, uint64(2), sub.Stats().Nacked)
	})
}

func TestTermStopsRedelivery(t *testing.T) {
	t.Parallel()
	forEachServer(t, func(t *testing.T, url string) {
		b := setup(t, url)
		sub := b.subscriber(t, idemnats.SubscriberConfig{NakDelay: func(uint64) time.Duration { return 50 * time.Millisecond }})
		msgs, err := sub.Subscribe(context.Background(), b.topic)
		require.NoError(t, err)
		b.publish(t, 2)

		first := receive(t, msgs, 30*time.Second)
		assert.True(t, idemnats.Term(first))
		first.Nack()
		second := receive(t, msgs, 30*time.Second)
		second.Nack() // not terminated: it comes back
		again := receive(t, msgs, 30*time.Second)
		assert.Equal(t, second.UUID, again.UUID)
		again.Ack()
		nothing(t, msgs, time.Second)
		assert.Equal(t, uint64(1), sub.Stats().Terminated)
		assert.False(t, idemnats.Term(message.NewMessage("x", nil)), "not from a Subscriber")
	})
}

func TestMsgIDDedupeWithinWindow(t *testing.T) {
	t.Parallel()
	forEachServer(t, func(t *testing.T, url string) {
		b := setup(t, url)
		sub := b.subscriber(t, idemnats.SubscriberConfig{})
		msgs, err := sub.Subscribe(context.Background(), b.topic)
		require.NoError(t, err)

		m := message.NewMessage("same-uuid", []byte("x"))
		require.NoError(t, b.pub.Publish(b.topic, m))
		require.NoError(t, b.pub.Publish(b.topic, m.Copy()))                                   // a producer retry
		require.NoError(t, b.pub.Publish(b.topic, m.Copy(), message.NewMessage("other", nil))) // in a batch
		assert.Equal(t, uint64(2), b.streamMsgs(t))

		got := map[string]int{}
		for range 2 {
			r := receive(t, msgs, 30*time.Second)
			got[r.UUID]++
			r.Ack()
		}
		nothing(t, msgs, 500*time.Millisecond)
		assert.Equal(t, map[string]int{"same-uuid": 1, "other": 1}, got)
	})
}

func TestSubscribersShareADurable(t *testing.T) {
	t.Parallel()
	forEachServer(t, func(t *testing.T, url string) {
		b := setup(t, url)
		const n = 200
		var mu sync.Mutex
		seen := map[string]int{}
		perSub := make([]int, 2)
		var wg sync.WaitGroup
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		for i := range 2 {
			s := b.subscriber(t, idemnats.SubscriberConfig{Concurrency: 4, Consumer: jetstream.ConsumerConfig{MaxAckPending: 8}})
			msgs, err := s.Subscribe(ctx, b.topic)
			require.NoError(t, err)
			wg.Add(1)
			go func() {
				defer wg.Done()
				for m := range msgs {
					time.Sleep(time.Millisecond) // a handler that takes a moment
					mu.Lock()
					seen[m.UUID]++
					perSub[i]++
					mu.Unlock()
					m.Ack()
				}
			}()
		}
		b.publish(t, n)
		pgtest.WaitFor(t, 20*time.Second, "every message seen", func() bool {
			mu.Lock()
			defer mu.Unlock()
			return len(seen) == n
		})
		cancel()
		wg.Wait()
		assert.Positive(t, perSub[0])
		assert.Positive(t, perSub[1])
	})
}

func TestMaxDeliverHookOnLastNack(t *testing.T) {
	t.Parallel()
	forEachServer(t, func(t *testing.T, url string) {
		b := setup(t, url)
		dlq := b.topic + "_dead"
		deadSub := b.subscriber(t, idemnats.SubscriberConfig{Durable: "dlq"})
		deadMsgs, err := deadSub.Subscribe(context.Background(), dlq)
		require.NoError(t, err)

		var mu sync.Mutex
		var calls []idemnats.MaxDelivered
		sub := b.subscriber(t, idemnats.SubscriberConfig{
			NakDelay: func(uint64) time.Duration { return 20 * time.Millisecond },
			Consumer: jetstream.ConsumerConfig{MaxDeliver: 3},
			OnMaxDeliver: func(ctx context.Context, d idemnats.MaxDelivered) error {
				mu.Lock()
				calls = append(calls, d)
				mu.Unlock()
				return idemnats.PublishDeadLetter(b.pub, dlq)(ctx, d)
			},
		})
		msgs, err := sub.Subscribe(context.Background(), b.topic)
		require.NoError(t, err)
		sent := b.publish(t, 1)[0]

		for i := 1; i <= 3; i++ {
			m := receive(t, msgs, 30*time.Second)
			assert.Equal(t, strconv.Itoa(i), m.Metadata.Get(idemnats.MetadataNumDelivered))
			m.Nack()
		}
		dead := receive(t, deadMsgs, 30*time.Second)
		assert.Equal(t, sent.UUID, dead.UUID)
		assert.Equal(t, "1", dead.Metadata.Get("dead_letter_stream_seq"))
		assert.Equal(t, "3", dead.Metadata.Get("dead_letter_deliveries"))
		dead.Ack()
		nothing(t, msgs, time.Second)

		mu.Lock()
		defer mu.Unlock()
		require.Len(t, calls, 1)
		assert.Equal(t, idemnats.MaxDeliveredByNack, calls[0].Source)
		assert.Equal(t, uint64(1), calls[0].StreamSeq)
		assert.Equal(t, uint64(3), calls[0].Deliveries)
		assert.Equal(t, uint64(1), sub.Stats().MaxDelivered)
	})
}

func TestMaxDeliverHookOnAdvisory(t *testing.T) {
	t.Parallel()
	forEachServer(t, func(t *testing.T, url string) {
		b := setup(t, url)
		found := make(chan idemnats.MaxDelivered, 4)
		sub := b.subscriber(t, idemnats.SubscriberConfig{
			Consumer: jetstream.ConsumerConfig{MaxDeliver: 1, AckWait: time.Second},
			OnMaxDeliver: func(_ context.Context, d idemnats.MaxDelivered) error {
				found <- d
				return nil
			},
		})
		require.NoError(t, sub.SubscribeInitialize(b.topic))
		sent := b.publish(t, 1)[0]

		// The only delivery goes to an instance that dies with it.
		cons, err := b.js.Consumer(context.Background(), b.topo.StreamName(b.topic), "test")
		require.NoError(t, err)
		batch, err := cons.Fetch(1, jetstream.FetchMaxWait(2*time.Second))
		require.NoError(t, err)
		require.NotNil(t, <-batch.Messages())

		msgs, err := sub.Subscribe(context.Background(), b.topic)
		require.NoError(t, err)
		select {
		case d := <-found:
			assert.Equal(t, idemnats.MaxDeliveredByAdvisory, d.Source)
			assert.Equal(t, uint64(1), d.StreamSeq)
			require.NotNil(t, d.Message)
			assert.Equal(t, sent.UUID, d.Message.UUID)
		case <-time.After(15 * time.Second):
			t.Fatal("no MAX_DELIVERIES advisory handled")
		}
		nothing(t, msgs, 500*time.Millisecond)
		assert.Equal(t, uint64(1), sub.Stats().MaxDelivered)
	})
}

// TestConsumerConfigWins shows which config wins for an existing consumer: the
// subscriber's, on nats-server 2.9 as on 2.10 and later.
func TestConsumerConfigWins(t *testing.T) {
	t.Parallel()
	forEachServer(t, func(t *testing.T, url string) {
		b := setup(t, url)
		first := b.subscriber(t, idemnats.SubscriberConfig{Consumer: jetstream.ConsumerConfig{AckWait: 5 * time.Second, MaxDeliver: 4}})
		require.NoError(t, first.SubscribeInitialize(b.topic))
		second := b.subscriber(t, idemnats.SubscriberConfig{Consumer: jetstream.ConsumerConfig{AckWait: 7 * time.Second, MaxDeliver: 6}})
		require.NoError(t, second.SubscribeInitialize(b.topic))

		c, err := b.js.Consumer(context.Background(), b.topo.StreamName(b.topic), "test")
		require.NoError(t, err)
		cfg := c.CachedInfo().Config
		assert.Equal(t, 7*time.Second, cfg.AckWait)
		assert.Equal(t, 6, cfg.MaxDeliver)
		assert.Equal(t, idemnats.DefaultMaxAckPending, cfg.MaxAckPending)
		assert.Equal(t, b.topo.Subject(b.topic), cfg.FilterSubject)
	})
}

func TestWithoutAutoProvisionTheServerConfigIsUsed(t *testing.T) {
	t.Parallel()
	forEachServer(t, func(t *testing.T, url string) {
		b := setup(t, url)
		topo := b.topo
		topo.AutoProvision = false
		_, err := b.js.CreateStream(context.Background(), jetstream.StreamConfig{Name: topo.StreamName(b.topic), Subjects: []string{topo.Subject(b.topic)}})
		require.NoError(t, err)

		sub, err := idemnats.NewSubscriber(b.nc, idemnats.SubscriberConfig{Topology: topo, Durable: "ops", PullExpiry: 200 * time.Millisecond})
		require.NoError(t, err)
		defer func() { require.NoError(t, sub.Close()) }()
		require.ErrorIs(t, sub.SubscribeInitialize(b.topic), jetstream.ErrConsumerNotFound)

		_, err = b.js.CreateOrUpdateConsumer(context.Background(), topo.StreamName(b.topic), jetstream.ConsumerConfig{Durable: "ops", AckPolicy: jetstream.AckNonePolicy})
		require.NoError(t, err)
		require.ErrorContains(t, sub.SubscribeInitialize(b.topic), "must be explicit")
	})
}

func TestAsyncPublishCloseWaitsForAcks(t *testing.T) {
	t.Parallel()
	forEachServer(t, func(t *testing.T, url string) {
		b := setup(t, url)
		pub, err := idemnats.NewPublisher(b.nc, idemnats.PublisherConfig{Topology: b.topo, Async: true, MaxInFlight: 4})
		require.NoError(t, err)
		for i := range 100 {
			require.NoError(t, pub.Publish(b.topic, message.NewMessage(fmt.Sprint(i), nil)))
		}
		require.NoError(t, pub.Close())
		assert.Equal(t, uint64(100), b.streamMsgs(t))
		assert.Zero(t, pub.AsyncFailures())
		assert.ErrorIs(t, pub.Publish(b.topic, message.NewMessage("late", nil)), idemnats.ErrClosed)
	})
}

// A closed Subscriber ends its subscriptions, refuses a new Subscribe with
// ErrClosed, and closes again without error.
func TestSubscriberClose(t *testing.T) {
	t.Parallel()
	forEachServer(t, func(t *testing.T, url string) {
		b := setup(t, url)
		sub, err := idemnats.NewSubscriber(b.nc, idemnats.SubscriberConfig{Topology: b.topo, Durable: "close", PullExpiry: 200 * time.Millisecond})
		require.NoError(t, err)
		msgs, err := sub.Subscribe(context.Background(), b.topic)
		require.NoError(t, err)
		require.NoError(t, sub.Close())
		_, open := <-msgs
		assert.False(t, open, "Close leaves the subscription's channel open")
		_, err = sub.Subscribe(context.Background(), b.topic)
		assert.ErrorIs(t, err, idemnats.ErrClosed)
		assert.NoError(t, sub.Close())
	})
}

func TestInvalidConfig(t *testing.T) {
	t.Parallel()
	forEachServer(t, func(t *testing.T, url string) {
		nc := connect(t, url)
		_, err := idemnats.NewSubscriber(nc, idemnats.SubscriberConfig{})
		assert.ErrorContains(t, err, "invalid config: Durable is empty")
		_, err = idemnats.NewSubscriber(nc, idemnats.SubscriberConfig{Durable: "a.b"})
		assert.ErrorContains(t, err, "invalid config")
		_, err = idemnats.NewSubscriber(nc, idemnats.SubscriberConfig{Durable: "d", Consumer: jetstream.ConsumerConfig{AckPolicy: jetstream.AckAllPolicy}})
		assert.ErrorContains(t, err, "must be explicit")
		_, err = idemnats.NewPublisher(nc, idemnats.PublisherConfig{MaxInFlight: -1})
		assert.ErrorContains(t, err, "invalid config: MaxInFlight")
	})
}

func TestExponentialBackoff(t *testing.T) {
	f := idemnats.ExponentialBackoff(time.Second, 5*time.Second)
	assert.Equal(t, []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 5 * time.Second, 5 * time.Second},
		[]time.Duration{f(1), f(2), f(3), f(4), f(100)})
}
