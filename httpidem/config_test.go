package httpidem_test

import (
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/httpidem"
	"github.com/idemkit/idem/inbox"
)

// TestConfigConvention: WithDefaults fills every default, Validate passes on a
// config that sets only what is required (it checks the defaulted config), and New
// refuses a config with "invalid config: " and a coded error. The deprecated names
// of the knobs are honoured.
func TestConfigConvention(t *testing.T) {
	t.Parallel()
	fresh := httpidem.Config{Pool: &pgxpool.Pool{}, Unscoped: true}
	require.NoError(t, fresh.Validate())
	d := fresh.WithDefaults()
	require.Equal(t, httpidem.DefaultSchema, d.Schema)
	require.Equal(t, httpidem.DefaultKeyHeader, d.KeyHeader)
	require.Equal(t, httpidem.DefaultLockTimeout, d.LockTimeout)
	require.Equal(t, httpidem.DefaultRetryAfter, d.RetryAfter)
	require.Equal(t, httpidem.DefaultRetention, d.Retention)
	require.Equal(t, httpidem.DefaultLease, d.Lease)
	require.EqualValues(t, httpidem.DefaultMaxRequestBody, d.MaxRequestBody)
	require.Equal(t, httpidem.DefaultMaxResponseBody, d.MaxResponseBody)
	require.Equal(t, httpidem.DefaultStoredHeaders, d.StoredHeaders)
	require.NotNil(t, d.Operation)
	require.NotNil(t, d.FinalStatus)
	require.NotNil(t, d.Logger)

	require.ErrorIs(t, httpidem.Config{Unscoped: true}.Validate(), httpidem.ErrInvalidConfig)
	_, err := httpidem.New(httpidem.Config{Pool: &pgxpool.Pool{}, Unscoped: true, Retention: time.Second})
	require.True(t, strings.HasPrefix(err.Error(), "invalid config: "), err.Error())
	require.ErrorIs(t, err, httpidem.ErrInvalidConfig)
	require.Equal(t, "invalid_config", inbox.Code(err))
	_, err = httpidem.New(httpidem.Config{Pool: &pgxpool.Pool{}})
	require.ErrorIs(t, err, httpidem.ErrScopeNotChosen)
}
