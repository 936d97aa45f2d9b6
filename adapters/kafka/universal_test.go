package kafka_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

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

// patientPublisher publishes again, for up to two minutes, when Publish fails,
// as docs/kafka.md tells users to (the same UUIDs; duplicates are the inbox's to
// drop). Watermill's suite publishes from goroutines that call require.NoError:
// a failure there ends the goroutine without its WaitGroup's Done, and the
// suite then hangs until the test binary's timeout instead of failing. On a
// loaded two-core machine a JVM broker can miss kafka-go's write timeouts a few
// times in a row; an error that lasts two minutes is still returned.
// It also notes each topic it publishes to, for dropTopicsAtEnd.
type patientPublisher struct {
	*kafka.Publisher
	topics *topicSet
}

func (p patientPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.topics.add(topic)
	deadline := time.Now().Add(2 * time.Minute)
	for {
		err := p.Publisher.Publish(topic, msgs...)
		if err == nil || errors.Is(err, kafka.ErrPublisherClosed) || time.Now().After(deadline) {
			return err
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func byPayload(_ string, msg *message.Message) ([]byte, error) { return msg.Payload, nil }

// universalRun is one configuration the suite runs with.
type universalRun struct {
	features tests.Features
	key      kafka.PartitionKeyFunc
	config   func(*kafka.SubscriberConfig)
}

// notingSubscriber notes each topic it subscribes to or initializes, for
// dropTopicsAtEnd.
type notingSubscriber struct {
	*kafka.Subscriber
	topics *topicSet
}

func (s notingSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	s.topics.add(topic)
	return s.Subscriber.Subscribe(ctx, topic)
}

func (s notingSubscriber) SubscribeInitialize(topic string) error {
	s.topics.add(topic)
	return s.Subscriber.SubscribeInitialize(topic)
}

func runUniversal(t *testing.T, brokers []string, run universalRun) {
	topics := &topicSet{}
	dropTopicsAtEnd(t, brokers, topics.list)
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
		cfg := subscriberConfig(brokers, group, universalPartitions)
		// TestContinueAfterErrors nacks one record 100 times in a row on
		// each of 3 subscribers: at the default cap of 10 s it would take
		// hours. The growth itself is nackbackoff_test.go's.
		cfg.NackBackoffMax = 2 * cfg.NackBackoff
		if run.config != nil {
			run.config(&cfg)
		}
		s := newSubscriber(t, cfg)
		mu.Lock()
		subs = append(subs, s)
		mu.Unlock()
		return s
	}

	pubSub := func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
		return patientPublisher{newPublisher(t, brokers, run.key), topics},
			notingSubscriber{newSub(t, group), topics}
	}
	tests.TestPubSub(t, run.features,
		func(t *testing.T) (message.Publisher, message.Subscriber) {
			// One group per suite test: the tests that re-create the
			// subscriber expect it to continue where the last one stopped.
			return pubSub(t, "universal-"+sanitize(t.Name()))
		},
		pubSub,
	)
}

// TestUniversal runs Watermill's suite against kfake, and also against the
// brokers in KAFKA_BROKERS when that is set (subtest "external=host:port").
func TestUniversal(t *testing.T) {
	t.Parallel()
	forEachBroker(t, func(t *testing.T, brokers []string) {
		runUniversal(t, brokers, universalRun{features: universalFeatures(), key: byPayload})
	})
}

// TestUniversalInFlight runs the suite with 8 records of each partition in
// flight. Order then holds per key, not per partition. The suite's publisher
// keys records by payload, and its in-order tests (TestPublishSubscribeInOrder
// checks order per payload; TestNoAck sends two records of one payload) ask
// exactly for order per key, so GuaranteedOrder stays true: that is the
// promise MaxInFlightPerPartition > 1 keeps for records that share a key.
func TestUniversalInFlight(t *testing.T) {
	t.Parallel()
	forEachBroker(t, func(t *testing.T, brokers []string) {
		runUniversal(t, brokers, universalRun{
			features: universalFeatures(),
			key:      byPayload,
			config:   func(c *kafka.SubscriberConfig) { c.MaxInFlightPerPartition = 8 },
		})
	})
}

// TestUniversalUnordered runs the suite with 64 records of each partition in
// flight, records published without a key and UnorderedWithoutKey: nothing
// keeps any order, so GuaranteedOrder is false (and the in-order tests are
// skipped). What is left to check is that nothing is lost under the most
// concurrency the subscriber allows.
func TestUniversalUnordered(t *testing.T) {
	t.Parallel()
	features := universalFeatures()
	features.GuaranteedOrder = false
	forEachBroker(t, func(t *testing.T, brokers []string) {
		runUniversal(t, brokers, universalRun{
			features: features,
			key:      nil,
			config: func(c *kafka.SubscriberConfig) {
				c.MaxInFlightPerPartition = 64
				c.UnorderedWithoutKey = true
			},
		})
	})
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
