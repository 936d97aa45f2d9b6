package kafka_test

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/idemkit/idem/adapters/kafka"
)

// Test timings: small enough that rebalances and Close are quick on a
// 2-core CI machine under -race, large enough not to flap.
const (
	testHeartbeat      = 100 * time.Millisecond
	testSessionTimeout = 2 * time.Second
)

// startCluster runs an in-process kfake cluster and returns its addresses.
func startCluster(t testing.TB) []string {
	t.Helper()
	c, err := kfake.NewCluster(
		kfake.NumBrokers(1),
		kfake.GroupMinSessionTimeout(100*time.Millisecond),
	)
	require.NoError(t, err)
	t.Cleanup(c.Close)
	return c.ListenAddrs()
}

// externalBrokers returns KAFKA_BROKERS split on commas, or nil.
func externalBrokers() []string {
	v := os.Getenv("KAFKA_BROKERS")
	if v == "" {
		return nil
	}
	return strings.Split(v, ",")
}

func testLogger() watermill.LoggerAdapter {
	if os.Getenv("KAFKA_TEST_DEBUG") != "" {
		return watermill.NewStdLogger(true, true)
	}
	return nil
}

func newPublisher(t testing.TB, brokers []string, key kafka.PartitionKeyFunc) *kafka.Publisher {
	t.Helper()
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{
		Brokers:      brokers,
		PartitionKey: key,
		Logger:       testLogger(),
	})
	require.NoError(t, err)
	return pub
}

func subscriberConfig(brokers []string, group string, partitions int) kafka.SubscriberConfig {
	cfg := kafka.SubscriberConfig{
		TopicPartitions: partitions,
		Logger:          testLogger(),
	}
	cfg.Brokers = brokers
	cfg.GroupID = group
	cfg.HeartbeatInterval = testHeartbeat
	cfg.SessionTimeout = testSessionTimeout
	cfg.NackBackoff = 10 * time.Millisecond
	if externalBrokers() != nil {
		cfg.TopicReplicationFactor = 1
	}
	return cfg
}

func newSubscriber(t testing.TB, cfg kafka.SubscriberConfig) *kafka.Subscriber {
	t.Helper()
	sub, err := kafka.NewSubscriber(cfg)
	require.NoError(t, err)
	return sub
}
