package chaos_test

import (
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/chaos"
)

// TestConfigConvention: every chaos config passes Validate when it sets only what
// is required (the zero Config injects no faults), WithDefaults fills the
// defaults, and the constructors refuse a config with "invalid config: " and a
// coded error.
func TestConfigConvention(t *testing.T) {
	t.Parallel()
	require.NoError(t, chaos.Config{}.Validate())
	d := chaos.Config{}.WithDefaults()
	require.Equal(t, chaos.DefaultMaxCopies, d.MaxCopies)
	require.Equal(t, chaos.DefaultRedeliverDelay, d.RedeliverDelay)
	require.Equal(t, chaos.DefaultNackDelay, d.NackDelay)
	require.Equal(t, chaos.DefaultReorderIdle, d.ReorderIdle)
	require.NotNil(t, d.Logger)
	require.NoError(t, chaos.PublisherConfig{}.Validate())
	require.NoError(t, chaos.AuditorConfig{Pool: &pgxpool.Pool{}}.Validate())
	require.Equal(t, chaos.DefaultSchema, chaos.AuditorConfig{}.WithDefaults().Schema)

	gc := gochannel.NewGoChannel(gochannel.Config{}, nil)
	t.Cleanup(func() { _ = gc.Close() })
	refusals := []func() error{
		func() error { _, err := chaos.NewSubscriber(gc, chaos.Config{DuplicateProbability: 2}); return err },
		func() error {
			_, err := chaos.NewPublisher(gc, chaos.PublisherConfig{DuplicateProbability: -1})
			return err
		},
		func() error { _, err := chaos.NewAuditor(chaos.AuditorConfig{}); return err },
		func() error { _, err := chaos.NewSubscriber(nil, chaos.Config{}); return err },
	}
	for i, refuse := range refusals {
		err := refuse()
		require.Error(t, err, i)
		require.True(t, strings.HasPrefix(err.Error(), "invalid config: "), err.Error())
		require.ErrorIs(t, err, chaos.ErrInvalidConfig)
	}
}
