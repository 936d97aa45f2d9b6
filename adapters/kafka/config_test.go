package kafka_test

import (
	"strings"
	"testing"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/internal/errcode"
)

// TestConfigConvention: both configs wrap kafka-go's own (WriterConfig,
// ReaderConfig), WithDefaults fills this package's defaults, Validate passes on a
// config that sets only what is required (it checks the defaulted config), and the
// constructors refuse a config with "invalid config: " and a coded error.
func TestConfigConvention(t *testing.T) {
	t.Parallel()
	pub := kafka.PublisherConfig{WriterConfig: kafkago.WriterConfig{Brokers: []string{"localhost:9092"}}}
	require.NoError(t, pub.Validate())
	pd := pub.WithDefaults()
	require.Equal(t, int(kafka.DefaultRequiredAcks), pd.RequiredAcks)
	require.Equal(t, kafka.DefaultMaxAttempts, pd.MaxAttempts)
	require.Equal(t, kafka.DefaultBatchSize, pd.BatchSize)
	require.Equal(t, kafka.DefaultBatchTimeout, pd.BatchTimeout)
	require.Equal(t, kafka.DefaultMetadataTTL, pd.RebalanceInterval)
	require.Equal(t, kafka.DefaultTopicWait, pd.TopicWait)
	require.NotNil(t, pd.Balancer)
	require.NotNil(t, pd.Dialer)
	require.NotNil(t, pd.Logger)
	require.NotNil(t, pd.Propagator)

	sub := kafka.SubscriberConfig{}
	sub.Brokers, sub.GroupID = []string{"localhost:9092"}, "g"
	require.NoError(t, sub.Validate())
	sd := sub.WithDefaults()
	require.Equal(t, kafka.DefaultMaxWait, sd.MaxWait)
	require.Equal(t, kafka.DefaultSessionTimeout, sd.SessionTimeout)
	require.Equal(t, kafka.DefaultHeartbeatInterval, sd.HeartbeatInterval)
	require.Equal(t, kafka.DefaultCommitInterval, sd.CommitInterval)
	require.Equal(t, kafka.DefaultNackBackoff, sd.NackBackoff)
	require.Equal(t, kafka.DefaultMaxInFlightPerPartition, sd.MaxInFlightPerPartition)
	require.Equal(t, kafkago.FirstOffset, sd.StartOffset)

	refused := []error{
		pub.WithDefaults().Validate(),
		kafka.PublisherConfig{}.Validate(),
		kafka.PublisherConfig{WriterConfig: kafkago.WriterConfig{Brokers: []string{"b"}, Topic: "t"}}.Validate(),
		kafka.PublisherConfig{WriterConfig: kafkago.WriterConfig{Brokers: []string{"b"}, RequiredAcks: 0x7f}}.Validate(),
		kafka.SubscriberConfig{}.Validate(),
	}
	require.NoError(t, refused[0], "a defaulted config passes again")
	for _, err := range refused[1:] {
		require.ErrorIs(t, err, kafka.ErrInvalidConfig)
		require.Equal(t, "invalid_config", errcode.Code(err))
	}
	_, err := kafka.NewPublisher(kafka.PublisherConfig{})
	require.True(t, strings.HasPrefix(err.Error(), "invalid config: "), err.Error())
	require.ErrorIs(t, err, kafka.ErrInvalidConfig)
	_, err = kafka.NewSubscriber(kafka.SubscriberConfig{})
	require.True(t, strings.HasPrefix(err.Error(), "invalid config: "), err.Error())
	require.ErrorIs(t, err, kafka.ErrInvalidConfig)
}
