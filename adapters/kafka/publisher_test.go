package kafka_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"net"

	"github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/internal/pgtest"
)

// newCluster starts a kfake cluster of its own, for a test that watches or
// slows every request the cluster sees.
func newCluster(t *testing.T) (*kfake.Cluster, []string) {
	t.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1),
		kfake.BrokerConfigs(map[string]string{"group.min.session.timeout.ms": "100"}))
	require.NoError(t, err)
	t.Cleanup(c.Close)
	return c, c.ListenAddrs()
}

// createTopics creates topics with one partition each.
func createTopics(t *testing.T, brokers []string, topics ...string) {
	t.Helper()
	transport := &kafkago.Transport{}
	defer transport.CloseIdleConnections()
	c := &kafkago.Client{Addr: kafkago.TCP(brokers...), Transport: transport, Timeout: 10 * time.Second}
	req := &kafkago.CreateTopicsRequest{}
	for _, topic := range topics {
		req.Topics = append(req.Topics, kafkago.TopicConfig{Topic: topic, NumPartitions: 1, ReplicationFactor: 1})
	}
	res, err := c.CreateTopics(context.Background(), req)
	require.NoError(t, err)
	for topic, err := range res.Errors {
		require.NoError(t, err, topic)
	}
}

// recordsIn is the number of records in partition 0 of topic.
func recordsIn(t *testing.T, brokers []string, topic string) int64 {
	t.Helper()
	return partitionEnds(t, &testBundle{brokers: brokers, topic: topic}, 1)[0]
}

func newMessages(n int) []*message.Message {
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprint(i)))
	}
	return msgs
}

// A broker slow to answer metadata does not fail Publish. kafka-go's
// transport gives its first metadata request as long as its metadata TTL
// (1 s here) and then, until a refresh succeeds, fails every write at once
// with the request's error. Publish waits for the metadata instead, and writes
// each record once. (This is how TestRebalanceLosesNothing failed in CI on a
// broker busy with the whole suite: "context deadline exceeded".)
func TestPublishWaitsForSlowMetadata(t *testing.T) {
	t.Parallel()
	cluster, brokers := newCluster(t)
	topic := "t-" + uuid.NewString()
	createTopics(t, brokers, topic)

	slowUntil := time.Now().Add(3 * time.Second)
	stop := make(chan struct{})
	t.Cleanup(func() { close(stop) }) // before the cluster closes
	var slowed atomic.Int64
	cluster.ControlKey(int16(kmsg.Metadata), func(kmsg.Request) (kmsg.Response, error, bool) {
		cluster.KeepControl()
		if time.Now().Before(slowUntil) {
			slowed.Add(1)
			cluster.SleepControl(func() {
				select {
				case <-time.After(1500 * time.Millisecond):
				case <-stop:
				}
			})
		}
		return nil, nil, false
	})

	pub := newPublisher(t, brokers, nil)
	defer func() { require.NoError(t, pub.Close()) }()
	start := time.Now()
	require.NoError(t, pub.Publish(topic, newMessages(5)...))
	require.Positive(t, slowed.Load(), "the broker answered metadata slowly")
	t.Logf("Publish returned after %s; %d metadata requests slowed", time.Since(start).Round(time.Millisecond), slowed.Load())
	require.Equal(t, int64(5), recordsIn(t, brokers, topic), "every record written once")
}

// A topic that does not come fails Publish after TopicWait with a message
// that says so and the broker's error, and nothing is written.
func TestPublishToMissingTopicFailsAfterTopicWait(t *testing.T) {
	t.Parallel()
	_, brokers := newCluster(t)
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{WriterConfig: kafkago.WriterConfig{Brokers: brokers}, TopicWait: 300 * time.Millisecond})
	require.NoError(t, err)
	defer func() { require.NoError(t, pub.Close()) }()

	start := time.Now()
	err = pub.Publish("no-such-topic", newMessages(1)...)
	require.ErrorIs(t, err, kafkago.UnknownTopicOrPartition)
	require.ErrorContains(t, err, "no metadata for the topic after 300ms, nothing written")
	require.GreaterOrEqual(t, time.Since(start), 300*time.Millisecond)

	require.ErrorContains(t, pub.Publish("", newMessages(1)...), "the topic is empty")
}

// The Publisher's metadata requests name the topics it publishes to, never
// the whole cluster: kafka.DefaultTransport's "all topics" answer is large on
// a cluster with thousands of partitions, and kafka-go refreshes it every
// metadata TTL.
func TestPublisherAsksOnlyForItsTopics(t *testing.T) {
	t.Parallel()
	cluster, brokers := newCluster(t)
	a, b := "a-"+uuid.NewString(), "b-"+uuid.NewString()
	createTopics(t, brokers, a, b, "other-"+uuid.NewString())

	var mu sync.Mutex
	var asked [][]string // topics of each metadata request; nil means all
	cluster.ControlKey(int16(kmsg.Metadata), func(req kmsg.Request) (kmsg.Response, error, bool) {
		cluster.KeepControl()
		var names []string
		if topics := req.(*kmsg.MetadataRequest).Topics; topics != nil {
			names = []string{}
			for _, topic := range topics {
				if topic.Topic != nil {
					names = append(names, *topic.Topic)
				}
			}
		}
		mu.Lock()
		asked = append(asked, names)
		mu.Unlock()
		return nil, nil, false
	})

	pub := newPublisher(t, brokers, nil)
	require.NoError(t, pub.Publish(a, newMessages(2)...))
	require.NoError(t, pub.Publish(b, newMessages(3)...))
	require.NoError(t, pub.Publish(a, newMessages(1)...))
	time.Sleep(2 * kafka.DefaultMetadataTTL) // a few periodic refreshes
	require.NoError(t, pub.Close())

	mu.Lock()
	seen := slices.Clone(asked)
	mu.Unlock()
	require.NotEmpty(t, seen)
	for _, names := range seen {
		require.NotNil(t, names, "a metadata request asked for every topic of the cluster")
		for _, name := range names {
			require.Contains(t, []string{a, b}, name)
		}
	}
	require.Equal(t, int64(3), recordsIn(t, brokers, a))
	require.Equal(t, int64(3), recordsIn(t, brokers, b))
}

// Publish calls to several topics at once, while the Publisher widens its
// writer topic by topic, and a Close in the middle: every call either writes
// its records or returns ErrPublisherClosed, and the topics hold exactly the
// records of the calls that succeeded. Run with -race.
func TestPublisherTopicsConcurrentlyAndClose(t *testing.T) {
	t.Parallel()
	_, brokers := newCluster(t)
	topics := make([]string, 4)
	for i := range topics {
		topics[i] = fmt.Sprintf("c%d-%s", i, uuid.NewString())
	}
	createTopics(t, brokers, topics...)

	pub := newPublisher(t, brokers, nil)
	var wg sync.WaitGroup
	var written [4]atomic.Int64
	var closedSeen atomic.Bool
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				topic := (g + i) % len(topics)
				err := pub.Publish(topics[topic], newMessages(2)...)
				if errors.Is(err, kafka.ErrPublisherClosed) {
					closedSeen.Store(true)
					return
				}
				if !assert.NoError(t, err) {
					return
				}
				written[topic].Add(2)
			}
		}()
	}
	pgtest.WaitFor(t, receiveTimeout, "every topic written", func() bool {
		for i := range written {
			if written[i].Load() == 0 {
				return false
			}
		}
		return true
	})
	require.NoError(t, pub.Close())
	require.NoError(t, pub.Close(), "Close twice")
	wg.Wait()
	require.True(t, closedSeen.Load())
	for i, topic := range topics {
		require.Equal(t, written[i].Load(), recordsIn(t, brokers, topic), "topic %d", i)
	}
}

// TestPublisherDialsThroughTheDialer: the Publisher's connections go through
// WriterConfig.Dialer (its DialFunc, as its TLS, SASL and client ID), as the
// Subscriber's do, so a TLS or SASL cluster is configured the same way for both.
func TestPublisherDialsThroughTheDialer(t *testing.T) {
	t.Parallel()
	_, brokers := newCluster(t)
	createTopics(t, brokers, "dialed")
	var dials atomic.Int64
	var d net.Dialer
	dialer := &kafkago.Dialer{DialFunc: func(ctx context.Context, network, address string) (net.Conn, error) {
		dials.Add(1)
		return d.DialContext(ctx, network, address)
	}}
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{WriterConfig: kafkago.WriterConfig{Brokers: brokers, Dialer: dialer}})
	require.NoError(t, err)
	defer func() { require.NoError(t, pub.Close()) }()
	require.NoError(t, pub.Publish("dialed", newMessages(3)...))
	require.Positive(t, dials.Load(), "the Publisher dialed through the Dialer")
	require.Equal(t, int64(3), recordsIn(t, brokers, "dialed"))
}
