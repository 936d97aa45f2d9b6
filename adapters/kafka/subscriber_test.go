package kafka_test

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/internal/pgtest"
)

const receiveTimeout = 15 * time.Second

type testBundle struct {
	brokers []string
	topic   string
	group   string
	pub     *kafka.Publisher
}

// setup gives a test its own topic, created with the given number of
// partitions, and its own group on brokers.
func setup(t *testing.T, brokers []string, partitions int) *testBundle {
	t.Helper()
	b := &testBundle{
		brokers: brokers,
		topic:   "t-" + uuid.NewString(),
		group:   "g-" + uuid.NewString(),
	}
	dropTopicsAtEnd(t, brokers, func() []string { return []string{b.topic} })
	init := newSubscriber(t, subscriberConfig(brokers, b.group, partitions))
	require.NoError(t, init.SubscribeInitialize(b.topic))
	require.NoError(t, init.Close())
	b.pub = newPublisher(t, brokers, kafka.PartitionKeyFromMetadata("key"))
	t.Cleanup(func() { _ = b.pub.Close() })
	return b
}

// publish sends n messages keyed so that they spread over the partitions,
// and returns them in publish order.
func (b *testBundle) publish(t *testing.T, n int) []*message.Message {
	t.Helper()
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), []byte(strconv.Itoa(i)))
		msgs[i].Metadata.Set("key", strconv.Itoa(i))
	}
	require.NoError(t, b.pub.Publish(b.topic, msgs...))
	return msgs
}

func (b *testBundle) subscribe(t *testing.T, cfg kafka.SubscriberConfig) (*kafka.Subscriber, <-chan *message.Message) {
	t.Helper()
	sub := newSubscriber(t, cfg)
	t.Cleanup(func() { _ = sub.Close() })
	ch, err := sub.Subscribe(context.Background(), b.topic)
	require.NoError(t, err)
	return sub, ch
}

func receive(t *testing.T, ch <-chan *message.Message) *message.Message {
	t.Helper()
	select {
	case msg, ok := <-ch:
		require.True(t, ok, "channel closed")
		return msg
	case <-time.After(receiveTimeout):
		t.Fatal("no message within", receiveTimeout)
		return nil
	}
}

func requireNothing(t *testing.T, ch <-chan *message.Message, d time.Duration) {
	t.Helper()
	select {
	case msg := <-ch:
		t.Fatalf("unexpected message %s (offset %s)", msg.UUID, msg.Metadata.Get(kafka.MetadataOffset))
	case <-time.After(d):
	}
}

// Acked messages are committed, and only those: after a restart the group
// continues at the first unacked message.
func TestCommitAfterAckAcrossRestart(t *testing.T) {
	t.Parallel()
	forEachBroker(t, func(t *testing.T, brokers []string) {
		b := setup(t, brokers, 1)
		sent := b.publish(t, 10)

		sub1, ch1 := b.subscribe(t, subscriberConfig(b.brokers, b.group, 1))
		for i := range 5 {
			msg := receive(t, ch1)
			require.Equal(t, sent[i].UUID, msg.UUID)
			msg.Ack()
		}
		held := receive(t, ch1) // delivered, never acked before the close
		require.Equal(t, sent[5].UUID, held.UUID)
		require.NoError(t, sub1.Close())
		held.Ack() // too late: the partition is released, this must not commit

		_, ch2 := b.subscribe(t, subscriberConfig(b.brokers, b.group, 1))
		for i := 5; i < 10; i++ {
			msg := receive(t, ch2)
			require.Equal(t, sent[i].UUID, msg.UUID, "message %d", i)
			require.Equal(t, strconv.Itoa(i), msg.Metadata.Get(kafka.MetadataOffset))
			msg.Ack()
		}
		requireNothing(t, ch2, 300*time.Millisecond)
	})
}

// A nack redelivers the same record after the backoff, with a higher
// delivery count, and the partition does not move past it meanwhile, neither
// in delivery nor in the committed offset.
func TestNackRedeliversWithoutAdvancing(t *testing.T) {
	t.Parallel()
	forEachBroker(t, func(t *testing.T, brokers []string) {
		b := setup(t, brokers, 1)
		sent := b.publish(t, 3)

		cfg := subscriberConfig(b.brokers, b.group, 1)
		cfg.NackBackoff = 200 * time.Millisecond
		sub1, ch := b.subscribe(t, cfg)

		first := receive(t, ch)
		require.Equal(t, sent[0].UUID, first.UUID)
		require.Equal(t, "1", first.Metadata.Get(kafka.MetadataDeliveryCount))
		nackedAt := time.Now()
		first.Nack()

		again := receive(t, ch)
		assert.GreaterOrEqual(t, time.Since(nackedAt), cfg.NackBackoff)
		require.Equal(t, sent[0].UUID, again.UUID)
		require.Equal(t, "0", again.Metadata.Get(kafka.MetadataOffset))
		require.Equal(t, "2", again.Metadata.Get(kafka.MetadataDeliveryCount))
		again.Nack()

		third := receive(t, ch)
		require.Equal(t, sent[0].UUID, third.UUID)
		require.Equal(t, "3", third.Metadata.Get(kafka.MetadataDeliveryCount))
		// Wait past a few commit intervals: nothing may be committed.
		time.Sleep(3 * kafka.DefaultCommitInterval)
		require.NoError(t, sub1.Close())

		_, ch2 := b.subscribe(t, subscriberConfig(b.brokers, b.group, 1))
		for i := range 3 {
			msg := receive(t, ch2)
			require.Equal(t, sent[i].UUID, msg.UUID, "message %d", i)
			require.Equal(t, "1", msg.Metadata.Get(kafka.MetadataDeliveryCount))
			msg.Ack()
		}
	})
}

// collector acks everything it receives and remembers who got what.
type collector struct {
	mu    sync.Mutex
	seen  map[string]int
	order map[string][]int // per partition, offsets in delivery order
}

func newCollector() *collector {
	return &collector{seen: map[string]int{}, order: map[string][]int{}}
}

func (c *collector) consume(ch <-chan *message.Message, delay time.Duration) {
	for msg := range ch {
		time.Sleep(delay)
		off, _ := strconv.Atoi(msg.Metadata.Get(kafka.MetadataOffset))
		c.mu.Lock()
		c.seen[msg.UUID]++
		p := msg.Metadata.Get(kafka.MetadataPartition)
		c.order[p] = append(c.order[p], off)
		c.mu.Unlock()
		msg.Ack()
	}
}

func (c *collector) missing(sent []*message.Message) []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var missing []string
	for _, m := range sent {
		if c.seen[m.UUID] == 0 {
			missing = append(missing, m.UUID)
		}
	}
	return missing
}

func (c *collector) duplicates() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	d := 0
	for _, n := range c.seen {
		d += n - 1
	}
	return d
}

func waitAll(t *testing.T, c *collector, sent []*message.Message) {
	t.Helper()
	pgtest.WaitFor(t, 30*time.Second, "every message received", func() bool { return len(c.missing(sent)) == 0 })
}

// Two members of one group share the partitions; a second member joining
// and the first one leaving move partitions around, and no message is lost.
func TestRebalanceLosesNothing(t *testing.T) {
	t.Parallel()
	forEachBroker(t, func(t *testing.T, brokers []string) {
		const partitions = 4
		b := setup(t, brokers, partitions)
		c := newCollector()

		sub1, ch1 := b.subscribe(t, subscriberConfig(b.brokers, b.group, partitions))
		go c.consume(ch1, time.Millisecond)
		sent := b.publish(t, 100)

		_, ch2 := b.subscribe(t, subscriberConfig(b.brokers, b.group, partitions))
		go c.consume(ch2, time.Millisecond)
		sent = append(sent, b.publish(t, 100)...)

		// Let the join finish and both members work, then take one away.
		time.Sleep(time.Second)
		sent = append(sent, b.publish(t, 100)...)
		require.NoError(t, sub1.Close())
		sent = append(sent, b.publish(t, 100)...)

		waitAll(t, c, sent)
		t.Logf("%d messages, %d duplicates", len(sent), c.duplicates())

		// Within each partition the first deliveries come in offset order: a
		// partition is never read by two members at once.
		c.mu.Lock()
		defer c.mu.Unlock()
		for p, offs := range c.order {
			high := -1
			for _, o := range offs {
				if o > high+1 {
					t.Fatalf("partition %s skipped from %d to %d", p, high, o)
				}
				high = max(high, o)
			}
		}
	})
}

// Without a group the Subscriber reads the chosen partitions from the given
// offset and commits nothing. Records from other producers, without the UUID
// header, arrive with an empty UUID and full Kafka metadata.
func TestWithoutGroupAndForeignRecords(t *testing.T) {
	t.Parallel()
	forEachBroker(t, func(t *testing.T, brokers []string) {
		b := setup(t, brokers, 2)

		transport := &kafkago.Transport{}
		defer transport.CloseIdleConnections()
		w := &kafkago.Writer{
			Addr:         kafkago.TCP(b.brokers...),
			Transport:    transport,
			Balancer:     kafkago.BalancerFunc(func(_ kafkago.Message, _ ...int) int { return 1 }),
			BatchTimeout: time.Millisecond,
			RequiredAcks: kafkago.RequireAll,
		}
		defer func() { require.NoError(t, w.Close()) }()
		var records []kafkago.Message
		for i := range 5 {
			records = append(records, kafkago.Message{
				Topic:   b.topic,
				Key:     []byte("order-" + strconv.Itoa(i)),
				Value:   []byte(fmt.Sprintf(`{"n":%d}`, i)),
				Headers: []kafkago.Header{{Key: "trace", Value: []byte("abc")}},
			})
		}
		pgtest.WaitFor(t, 10*time.Second, "the records written", func() bool {
			return w.WriteMessages(context.Background(), records...) == nil
		})

		cfg := subscriberConfig(b.brokers, "", 0)
		cfg.Partitions = []int{1}
		cfg.StartOffset = 2
		sub, ch := b.subscribe(t, cfg)
		for i := 2; i < 5; i++ {
			msg := receive(t, ch)
			assert.Empty(t, msg.UUID)
			assert.Equal(t, fmt.Sprintf(`{"n":%d}`, i), string(msg.Payload))
			assert.Equal(t, b.topic, msg.Metadata.Get(kafka.MetadataTopic))
			assert.Equal(t, "1", msg.Metadata.Get(kafka.MetadataPartition))
			assert.Equal(t, strconv.Itoa(i), msg.Metadata.Get(kafka.MetadataOffset))
			assert.Equal(t, "order-"+strconv.Itoa(i), msg.Metadata.Get(kafka.MetadataKey))
			assert.Equal(t, "abc", msg.Metadata.Get("trace"))
			assert.NotEmpty(t, msg.Metadata.Get(kafka.MetadataTimestamp))
			assert.Equal(t, fmt.Sprintf("%s/1/%d", b.topic, i), kafka.PartitionOffsetKey(msg))
			msg.Ack()
		}
		requireNothing(t, ch, 200*time.Millisecond)
		require.NoError(t, sub.Close())
		_, open := <-ch
		require.False(t, open, "Close closes the channel")
	})
}

// Our own messages keep UUID and metadata end to end.
func TestUUIDAndMetadataRoundTrip(t *testing.T) {
	t.Parallel()
	forEachBroker(t, func(t *testing.T, brokers []string) {
		b := setup(t, brokers, 1)
		msg := message.NewMessage(watermill.NewUUID(), []byte("hello"))
		msg.Metadata.Set("tenant", "acme")
		msg.Metadata.Set("key", "k1")
		require.NoError(t, b.pub.Publish(b.topic, msg))

		_, ch := b.subscribe(t, subscriberConfig(b.brokers, b.group, 1))
		got := receive(t, ch)
		assert.Equal(t, msg.UUID, got.UUID)
		assert.Equal(t, "acme", got.Metadata.Get("tenant"))
		assert.Equal(t, "k1", got.Metadata.Get(kafka.MetadataKey))
		assert.Empty(t, got.Metadata.Get(kafka.UUIDHeader))
		got.Ack()
	})
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	_, err := kafka.NewPublisher(kafka.PublisherConfig{})
	require.ErrorContains(t, err, "invalid config: ")

	_, err = kafka.NewSubscriber(kafka.SubscriberConfig{})
	require.ErrorContains(t, err, "invalid config: ")

	cfg := subscriberConfig([]string{"localhost:9092"}, "g", 1)
	cfg.Topic = "set-by-subscribe"
	_, err = kafka.NewSubscriber(cfg)
	require.ErrorContains(t, err, "Topic")

	cfg = subscriberConfig([]string{"localhost:9092"}, "g", 1)
	cfg.StartOffset = 5
	_, err = kafka.NewSubscriber(cfg)
	require.ErrorContains(t, err, "StartOffset")

	cfg = subscriberConfig([]string{"localhost:9092"}, "g", 1)
	cfg.HeartbeatInterval = time.Minute
	_, err = kafka.NewSubscriber(cfg)
	require.ErrorContains(t, err, "HeartbeatInterval")

	// Kafka's guidance: heartbeats at most a third of the session.
	cfg = subscriberConfig([]string{"localhost:9092"}, "g", 1)
	cfg.SessionTimeout, cfg.HeartbeatInterval = 6*time.Second, 2001*time.Millisecond
	_, err = kafka.NewSubscriber(cfg)
	require.ErrorContains(t, err, "HeartbeatInterval 2.001s must be at most a third of SessionTimeout 6s")
	cfg.HeartbeatInterval = 2 * time.Second
	_, err = kafka.NewSubscriber(cfg)
	require.NoError(t, err)

	// The group protocol carries whole milliseconds in an int32.
	cfg = subscriberConfig([]string{"localhost:9092"}, "g", 1)
	cfg.SessionTimeout, cfg.HeartbeatInterval = 900*time.Microsecond, 100*time.Microsecond
	_, err = kafka.NewSubscriber(cfg)
	require.ErrorContains(t, err, "SessionTimeout 900µs must be between 1ms")
	cfg = subscriberConfig([]string{"localhost:9092"}, "g", 1)
	cfg.SessionTimeout = 1000 * time.Hour
	_, err = kafka.NewSubscriber(cfg)
	require.ErrorContains(t, err, "SessionTimeout 1000h0m0s must be between 1ms")

	cfg = subscriberConfig([]string{"localhost:9092"}, "g", 1)
	cfg.MaxInFlightPerPartition = -1
	_, err = kafka.NewSubscriber(cfg)
	require.ErrorContains(t, err, "MaxInFlightPerPartition must not be negative")

	// The pause after nacks grows from NackBackoff to NackBackoffMax; a
	// NackBackoff above the default cap raises the cap with it.
	cfg = subscriberConfig([]string{"localhost:9092"}, "g", 1)
	cfg.NackBackoff, cfg.NackBackoffMax = time.Second, 500*time.Millisecond
	_, err = kafka.NewSubscriber(cfg)
	require.ErrorContains(t, err, "NackBackoffMax 500ms must be at least NackBackoff 1s")
	cfg.NackBackoff, cfg.NackBackoffMax = time.Minute, 0
	_, err = kafka.NewSubscriber(cfg)
	require.NoError(t, err)

	// Without a group the timings are not used.
	cfg = subscriberConfig([]string{"localhost:9092"}, "", 1)
	cfg.HeartbeatInterval = time.Minute
	_, err = kafka.NewSubscriber(cfg)
	require.NoError(t, err)
}

// SubscribeInitialize returns only once the brokers' metadata lists the new topic
// with a leader for every partition: a group that joins right after is assigned
// them (kafka-go's group assigns nothing of a topic its metadata does not list
// yet, and never assigns it later). Ten fresh topics, each checked at once.
func TestSubscribeInitializeWaitsForLeaders(t *testing.T) {
	t.Parallel()
	forEachBroker(t, func(t *testing.T, brokers []string) {
		sub := newSubscriber(t, subscriberConfig(brokers, "g-"+watermill.NewUUID(), 4))
		t.Cleanup(func() { _ = sub.Close() })
		var topics []string
		dropTopicsAtEnd(t, brokers, func() []string { return topics })
		for range 10 {
			topic := "t-" + watermill.NewUUID()
			topics = append(topics, topic)
			require.NoError(t, sub.SubscribeInitialize(topic))
			// A transport of its own: a transport answers from its metadata cache.
			transport := &kafkago.Transport{}
			client := &kafkago.Client{Addr: kafkago.TCP(brokers...), Timeout: 10 * time.Second, Transport: transport}
			md, err := client.Metadata(context.Background(), &kafkago.MetadataRequest{Topics: []string{topic}})
			require.NoError(t, err)
			require.Len(t, md.Topics, 1)
			require.NoError(t, md.Topics[0].Error)
			require.Len(t, md.Topics[0].Partitions, 4)
			for _, p := range md.Topics[0].Partitions {
				require.NotEmpty(t, p.Leader.Host, "partition %d has no leader", p.ID)
			}
			transport.CloseIdleConnections()
		}
	})
}
