package consumer_test

import (
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
)

// TestConfigConvention: WithDefaults fills every default, Validate passes on a
// config that sets only what is required (it checks the defaulted config), and New
// refuses a config with "invalid config: " and a coded error.
func TestConfigConvention(t *testing.T) {
	t.Parallel()
	fresh := consumer.Config{Pool: &pgxpool.Pool{}}
	require.NoError(t, fresh.Validate())

	d := fresh.WithDefaults()
	require.Equal(t, consumer.DefaultSchema, d.Schema)
	require.Equal(t, consumer.DefaultRetention, d.Retention)
	require.Equal(t, consumer.DefaultLockTimeout, d.LockTimeout)
	require.Equal(t, consumer.DefaultBusyDelay, d.BusyDelay)
	require.Equal(t, consumer.DefaultLease, d.Lease)
	require.Equal(t, consumer.DefaultCommitTimeout, d.CommitTimeout)
	require.Equal(t, consumer.DefaultMaxBatch, d.MaxBatch)
	require.Equal(t, consumer.DefaultMaxWait, d.MaxWait)
	require.Equal(t, consumer.DefaultWorkers, d.Workers)
	require.NotNil(t, d.Key)
	require.NotNil(t, d.Fingerprint)
	require.NotNil(t, d.Logger)

	require.ErrorIs(t, consumer.Config{}.Validate(), consumer.ErrInvalidConfig)
	_, err := consumer.New(consumer.Config{Pool: &pgxpool.Pool{}, Retention: time.Second})
	require.True(t, strings.HasPrefix(err.Error(), "invalid config: "), err.Error())
	require.ErrorIs(t, err, consumer.ErrInvalidConfig)
	require.Equal(t, "invalid_config", consumer.Code(err))
}
