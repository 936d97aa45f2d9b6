package inbox_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/inbox"
)

func TestKeyValidation(t *testing.T) {
	t.Parallel()
	cases := map[string]error{
		"":                                   inbox.ErrEmptyKey,
		strings.Repeat("x", 10*1024):         inbox.ErrKeyTooLong,
		"bad\xff":                            inbox.ErrKeyInvalid,
		"nul\x00":                            inbox.ErrKeyInvalid,
		strings.Repeat("x", inbox.MaxKeyLen): nil,
	}
	for key, want := range cases {
		err := inbox.ValidateKey(key)
		if want == nil {
			require.NoError(t, err)
			continue
		}
		require.ErrorIs(t, err, want)
		require.True(t, inbox.IsPermanent(err))
		require.NotEmpty(t, inbox.Code(err))
	}
}
