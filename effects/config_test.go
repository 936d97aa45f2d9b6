package effects_test

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/inbox"
)

// TestConfigConvention: WithDefaults fills every default, Validate passes on a
// config that sets only what is required (it checks the defaulted config), and the
// constructors refuse a config with "invalid config: " and a coded error. The same
// for the Dispatcher's Config, its Backoff and the ledger sender's LedgerConfig.
func TestConfigConvention(t *testing.T) {
	t.Parallel()
	noop := effects.SenderFunc(func(context.Context, effects.Delivery) error { return nil })
	fresh := effects.Config{Pool: &pgxpool.Pool{}, Senders: map[string]effects.Sender{"mail": noop}}
	require.NoError(t, fresh.Validate())
	d := fresh.WithDefaults()
	require.Equal(t, effects.DefaultSchema, d.Schema)
	require.Equal(t, effects.DefaultBatchSize, d.BatchSize)
	require.Equal(t, effects.DefaultLease, d.Lease)
	require.Equal(t, effects.DefaultPollInterval, d.PollInterval)
	require.Equal(t, effects.DefaultShutdownTimeout, d.ShutdownTimeout)
	require.Equal(t, effects.DefaultPendingRefresh, d.PendingRefresh)
	require.Equal(t, effects.Backoff{}.WithDefaults(), d.Backoff)
	require.NotNil(t, d.Logger)

	b := effects.Backoff{}.WithDefaults()
	require.Equal(t, effects.Backoff{Initial: effects.DefaultBackoffInitial, Max: effects.DefaultBackoffMax,
		Multiplier: effects.DefaultBackoffMultiplier, Jitter: effects.DefaultBackoffJitter}, b)
	require.NoError(t, effects.Backoff{}.Validate())
	require.ErrorIs(t, effects.Backoff{Multiplier: 0.5}.Validate(), effects.ErrInvalidConfig)

	for _, bad := range []effects.Config{{}, {Pool: &pgxpool.Pool{}}, {Pool: &pgxpool.Pool{}, Senders: fresh.Senders, BatchSize: -1}} {
		require.ErrorIs(t, bad.Validate(), effects.ErrInvalidConfig)
		_, err := effects.NewDispatcher(bad)
		require.True(t, strings.HasPrefix(err.Error(), "invalid config: "), err.Error())
		require.ErrorIs(t, err, effects.ErrInvalidConfig)
		require.Equal(t, "invalid_config", inbox.Code(err))
	}

	tenant := fresh
	tenant.Tenant = "acme"
	require.NoError(t, tenant.Validate())
	for _, bad := range []string{"bad\x00", "bad\xff", strings.Repeat("t", effects.MaxKeyLen+1)} {
		tenant.Tenant = bad
		require.ErrorIs(t, tenant.Validate(), effects.ErrInvalidTenant, "%q", bad)
	}
	_, err := effects.NewDispatcher(tenant)
	require.True(t, strings.HasPrefix(err.Error(), "invalid config: "), err.Error())

	ledger := effects.LedgerConfig{Pool: &pgxpool.Pool{}, Table: "ledger"}
	require.NoError(t, ledger.Validate())
	require.Equal(t, effects.DefaultLedgerKeyColumn, ledger.WithDefaults().KeyColumn)
	require.Equal(t, effects.DefaultLedgerPayloadColumn, ledger.WithDefaults().PayloadColumn)
	_, err = effects.NewLedgerSender(effects.LedgerConfig{Table: "ledger"})
	require.ErrorIs(t, err, effects.ErrInvalidConfig)
	require.True(t, strings.HasPrefix(err.Error(), "invalid config: "), err.Error())
	_, err = effects.NewLedgerSender(effects.LedgerConfig{Pool: &pgxpool.Pool{}, Table: "ledger"})
	require.NoError(t, err)
}
