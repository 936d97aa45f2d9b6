package nats_test

import (
	"strings"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/adapters/nats"
	"github.com/idemkit/idem/internal/errcode"
)

// TestConfigConvention: WithDefaults fills this package's defaults (and the
// Topology's), Validate passes on a config that sets only what is required (it
// checks the defaulted config), and the constructors refuse a config with
// "invalid config: " and a coded error.
func TestConfigConvention(t *testing.T) {
	t.Parallel()
	require.NoError(t, nats.PublisherConfig{}.Validate())
	pd := nats.PublisherConfig{}.WithDefaults()
	require.Equal(t, nats.DefaultMaxInFlight, pd.MaxInFlight)
	require.Equal(t, nats.DefaultPublishTimeout, pd.PublishTimeout)
	require.Equal(t, nats.DefaultCloseTimeout, pd.CloseTimeout)
	require.Equal(t, nats.DefaultDuplicateWindow, pd.Stream.Duplicates)
	require.NotNil(t, pd.StreamName)
	require.NotNil(t, pd.Subject)

	sub := nats.SubscriberConfig{Durable: "billing"}
	require.NoError(t, sub.Validate())
	sd := sub.WithDefaults()
	require.Equal(t, nats.DefaultConcurrency, sd.Concurrency)
	require.Equal(t, nats.DefaultFetchBatch, sd.FetchBatch)
	require.Equal(t, nats.DefaultAckWait, sd.Consumer.AckWait)
	require.Equal(t, nats.DefaultMaxDeliver, sd.Consumer.MaxDeliver)
	require.Equal(t, nats.DefaultPullExpiry, sd.PullExpiry)
	require.Equal(t, nats.DefaultAckTimeout, sd.AckTimeout)
	require.Equal(t, "billing", sd.ConsumerName("orders"))
	require.NotNil(t, sd.NakDelay)

	for _, err := range []error{
		nats.SubscriberConfig{}.Validate(),
		nats.SubscriberConfig{Durable: "a.b"}.Validate(),
		nats.SubscriberConfig{Durable: "d", Consumer: jetstream.ConsumerConfig{AckPolicy: jetstream.AckNonePolicy}}.Validate(),
		nats.PublisherConfig{MaxInFlight: -1}.Validate(),
	} {
		require.ErrorIs(t, err, nats.ErrInvalidConfig)
		require.Equal(t, "invalid_config", errcode.Code(err))
	}
	_, err := nats.NewSubscriber(nil, sub)
	require.True(t, strings.HasPrefix(err.Error(), "invalid config: "), err.Error())
	require.ErrorIs(t, err, nats.ErrInvalidConfig)
}
