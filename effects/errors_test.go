package effects_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/effectsdb"
)

// TestSentinelsAreTheEnginesValues: what the enqueue engine in internal/effectsdb
// returns is the value effects exports, so errors.Is against effects' sentinels
// holds for effects enqueued through a consumer's or httpidem's scope.
func TestSentinelsAreTheEnginesValues(t *testing.T) {
	t.Parallel()
	require.ErrorIs(t, effectsdb.ValidateEffect(effectsdb.Effect{Key: "k"}), effects.ErrInvalidKind)
	require.ErrorIs(t, effectsdb.ValidateEffect(effectsdb.Effect{Kind: "email"}), effects.ErrInvalidKey)
	require.ErrorIs(t, effectsdb.ValidateTenant("bad\x00"), effects.ErrInvalidTenant)
	require.Equal(t, effectsdb.MaxPayloadLen, effects.MaxPayloadLen)
}
