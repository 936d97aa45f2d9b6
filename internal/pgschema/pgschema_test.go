package pgschema_test

import (
	"errors"
	"fmt"
	"regexp"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/pgschema"
)

// Valid is the regular expression the error message states, byte for byte.
func TestValidMatchesTheRule(t *testing.T) {
	t.Parallel()
	rule := regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)
	for _, s := range []string{"", "idem", "_x", "a1", "1a", "A", "a-b", "a b", "é", "t_0123456789abcdef",
		"a123456789012345678901234567890123456789012345678901234567890bc",
		"a123456789012345678901234567890123456789012345678901234567890bcd"} {
		require.Equal(t, rule.MatchString(s), pgschema.Valid(s), "%q", s)
		if rule.MatchString(s) {
			require.NoError(t, pgschema.Validate(s))
		} else {
			require.ErrorIs(t, pgschema.Validate(s), pgschema.ErrInvalid, "%q", s)
		}
	}
}

func TestWrap(t *testing.T) {
	t.Parallel()
	for code, missing := range map[string]bool{"42P01": true, "3F000": true, "42703": true, "23505": false} {
		err := pgschema.Wrap(fmt.Errorf("query: %w", &pgconn.PgError{Code: code}), "s")
		require.Equal(t, missing, errors.Is(err, pgschema.ErrMissing), code)
	}
	require.NoError(t, pgschema.Wrap(nil, "s"))
	require.Equal(t, `"my""schema"`, pgschema.Quote(`my"schema`))
	require.Equal(t, `"s"."inbox"`, pgschema.Table("s", "inbox"))
}

func TestValidateDB(t *testing.T) {
	t.Parallel()
	type db interface{ Ping() error }
	var nilDB db
	require.ErrorIs(t, pgschema.ValidateDB(nilDB, "idem"), errcode.ErrInvalidConfig)
	var nilPtr *struct{}
	require.ErrorIs(t, pgschema.ValidateDB(nilPtr, "idem"), errcode.ErrInvalidConfig)
	require.ErrorIs(t, pgschema.ValidateDB(&struct{}{}, "Bad"), pgschema.ErrInvalid)
	require.NoError(t, pgschema.ValidateDB(&struct{}{}, "idem"))
}
