package effects_test

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/inbox"
)

// effects keeps its own copy of inbox.SanitizeText (it imports nothing of idem);
// the two must never drift apart.
func TestSanitizeTextTwinOfInbox(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(3, 4))
	alphabet := []string{"a", "\x00", "\xff", "\xc3", "\xa9", "é", "✓", "\\", "…", "\xed\xa0\x80", "\U0001F600"}
	for range 20000 {
		var s string
		for range r.IntN(40) {
			s += alphabet[r.IntN(len(alphabet))]
		}
		maxBytes := r.IntN(48) - 4
		require.Equal(t, inbox.SanitizeText(s, maxBytes), effects.SanitizeText(s, maxBytes), "%q max %d", s, maxBytes)
	}
}
