package migrate_test

import (
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/migrate"
)

// TestConfigConvention: Validate passes on a config that sets only what is
// required (it checks the defaulted config), WithDefaults fills the schema, and New
// refuses a config with "invalid config: " and a coded error.
func TestConfigConvention(t *testing.T) {
	t.Parallel()
	fresh := migrate.Config{Pool: &pgxpool.Pool{}}
	require.NoError(t, fresh.Validate())
	require.Equal(t, inbox.DefaultSchema, fresh.WithDefaults().Schema)
	m, err := migrate.New(fresh)
	require.NoError(t, err)
	require.Equal(t, inbox.DefaultSchema, m.Schema())

	_, err = migrate.New(migrate.Config{})
	require.True(t, strings.HasPrefix(err.Error(), "invalid config: "), err.Error())
	require.ErrorIs(t, err, migrate.ErrInvalidConfig)
	require.Equal(t, "invalid_config", inbox.Code(err))
	_, err = migrate.New(migrate.Config{Pool: &pgxpool.Pool{}, Schema: "Bad"})
	require.ErrorIs(t, err, inbox.ErrInvalidSchema)
}
