package consumer_test

import (
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/inbox"
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
	require.Equal(t, consumer.DefaultLease, consumer.Config{Pool: &pgxpool.Pool{}, Mode: consumer.Lease}.WithDefaults().Lease)
	require.Equal(t, consumer.DefaultCommitTimeout, d.CommitTimeout)
	require.Equal(t, consumer.DefaultMaxBatch, d.Batch.MaxBatch)
	require.Equal(t, consumer.DefaultMaxWait, d.Batch.MaxWait)
	require.Equal(t, consumer.DefaultWorkers, d.Batch.Workers)
	require.NotNil(t, d.Key)
	require.NotNil(t, d.Fingerprint)
	require.NotNil(t, d.Logger)

	require.ErrorIs(t, consumer.Config{}.Validate(), consumer.ErrInvalidConfig)
	_, err := consumer.New(consumer.Config{Pool: &pgxpool.Pool{}, Retention: time.Second})
	require.True(t, strings.HasPrefix(err.Error(), "invalid config: "), err.Error())
	require.ErrorIs(t, err, consumer.ErrInvalidConfig)
	require.Equal(t, "invalid_config", inbox.Code(err))
}

// TestConfigRefusesAFieldTheModeDoesNotUse: Batch does nothing in Lease mode, and
// Lease nothing in the other modes; Validate (and New) refuse them, with a coded
// error that names the field and the mode, instead of ignoring them.
func TestConfigRefusesAFieldTheModeDoesNotUse(t *testing.T) {
	t.Parallel()
	pool := &pgxpool.Pool{}
	for _, tc := range []struct {
		cfg         consumer.Config
		field, mode string
	}{
		{consumer.Config{Pool: pool, Mode: consumer.Lease, Batch: consumer.BatchConfig{MaxBatch: 8}}, "Batch", "lease"},
		{consumer.Config{Pool: pool, Mode: consumer.Lease, Batch: consumer.BatchConfig{PerTenant: true}}, "Batch", "lease"},
		{consumer.Config{Pool: pool, Lease: time.Minute}, "Lease", "transactional"},
		{consumer.Config{Pool: pool, Mode: consumer.GroupCommit, Lease: time.Minute}, "Lease", "group-commit"},
	} {
		err := tc.cfg.Validate()
		require.ErrorIs(t, err, consumer.ErrInvalidConfig, "%s in %s mode", tc.field, tc.mode)
		require.Contains(t, err.Error(), tc.field+" ")
		require.Contains(t, err.Error(), "Mode is "+tc.mode)
		_, err = consumer.New(tc.cfg)
		require.ErrorIs(t, err, consumer.ErrInvalidConfig)
	}
	for _, ok := range []consumer.Config{
		{Pool: pool, Mode: consumer.Lease, Lease: time.Minute},
		{Pool: pool, Mode: consumer.GroupCommit, Batch: consumer.BatchConfig{MaxBatch: 8, PerTenant: true}},
		{Pool: pool, Batch: consumer.BatchConfig{MaxBatch: 256}}, // for HandleBatch
	} {
		require.NoError(t, ok.Validate())
		require.NoError(t, ok.WithDefaults().Validate(), "a defaulted config stays valid")
	}
}
