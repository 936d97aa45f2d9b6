package errcode_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/errcode"
)

func TestCodeAndPermanence(t *testing.T) {
	t.Parallel()
	perm := errcode.Permanent("empty_key", "empty idempotency key")
	trans := errcode.Transient("busy", "busy")
	require.Equal(t, "idem: empty idempotency key", perm.Error())
	require.Equal(t, "empty_key", perm.Code())
	require.True(t, perm.Permanent())
	require.False(t, trans.Permanent())

	wrapped := fmt.Errorf("claim: %w", perm)
	require.ErrorIs(t, wrapped, perm)
	require.Equal(t, "empty_key", errcode.Code(wrapped))
	require.True(t, errcode.IsPermanent(wrapped))
	require.False(t, errcode.IsPermanent(fmt.Errorf("x: %w", trans)))
	require.Empty(t, errcode.Code(errors.New("plain")))
	require.False(t, errcode.IsPermanent(nil))
	// The first coded error in the chain decides.
	require.Equal(t, "busy", errcode.Code(fmt.Errorf("%w: %w", trans, perm)))
}

func TestInvalidConfig(t *testing.T) {
	t.Parallel()
	err := fmt.Errorf("invalid config: %w", errcode.InvalidConfig("BatchSize %d is outside 1..%d", 0, 10))
	require.Equal(t, "invalid config: BatchSize 0 is outside 1..10", err.Error())
	require.ErrorIs(t, err, errcode.ErrInvalidConfig)
	require.Equal(t, "invalid_config", errcode.Code(err))
	require.True(t, errcode.IsPermanent(err))
}
