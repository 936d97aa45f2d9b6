package httpidem_test

import (
	"net/http"
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
	require.Equal(t, httpidem.DefaultLease, d.Lease.Duration)
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

// TestConfigRefusesAKnobOfAnotherMode: a field that does nothing in the mode the
// rest of the config chose is refused with invalid_config, naming the field and
// the mode, not silently ignored: Fields chooses the default fingerprint's fields,
// and does nothing beside a Fingerprint of one's own.
func TestConfigRefusesAKnobOfAnotherMode(t *testing.T) {
	t.Parallel()
	own := func(*http.Request, []byte) ([]byte, error) { return nil, nil }
	for _, fields := range []inbox.JSONOptions{{Exclude: []string{"email"}}, {Include: []string{"amount"}}} {
		c := httpidem.Config{Pool: &pgxpool.Pool{}, Unscoped: true, Fingerprint: own, Fields: fields}
		err := c.Validate()
		require.ErrorIs(t, err, httpidem.ErrInvalidConfig)
		require.Equal(t, "invalid_config", inbox.Code(err))
		require.ErrorContains(t, err, "Fields")
		require.ErrorContains(t, err, "Fingerprint set")
		_, err = httpidem.New(c)
		require.ErrorIs(t, err, httpidem.ErrInvalidConfig)
	}
	require.NoError(t, httpidem.Config{Pool: &pgxpool.Pool{}, Unscoped: true, Fingerprint: own}.Validate())
	require.NoError(t, httpidem.Config{Pool: &pgxpool.Pool{}, Unscoped: true, Fields: inbox.JSONOptions{Exclude: []string{"email"}}}.Validate())
}
