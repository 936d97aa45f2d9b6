package text_test

import (
	"math/rand/v2"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/text"
)

func TestSanitize(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in   string
		max  int
		want string
	}{
		{"plain", 0, "plain"},
		{"plain", 5, "plain"},
		{"nul\x00byte", 0, `nul\x00byte`},
		{"bad \xff\xfe utf8", 0, `bad \xff\xfe utf8`},
		{"cut \xc3", 0, `cut \xc3`},                             // a truncated multi-byte sequence
		{"surrogate \xed\xa0\x80", 0, `surrogate \xed\xa0\x80`}, // Postgres rejects it too
		{"ünïcödé ✓", 0, "ünïcödé ✓"},
		{"0123456789", 8, "01234…"},
		{"0123456789", 10, "0123456789"},
		{"ab✓✓✓", 8, "ab✓…"},         // never inside a multi-byte character
		{"ab\x00\x00\x00", 8, "ab…"}, // never inside an escape
		{"ab\x00", 6, `ab\x00`},      // fits whole after escaping
		{"abcdef", 2, "ab"},
	} {
		got := text.Sanitize(tc.in, tc.max)
		require.Equal(t, tc.want, got, "%q max %d", tc.in, tc.max)
	}
}

// Whatever the input, the result is text Postgres takes, within the limit.
func TestSanitizeAnyBytes(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(1, 2))
	for range 20000 {
		b := make([]byte, r.IntN(64))
		for i := range b {
			b[i] = byte(r.IntN(256))
		}
		maxBytes := r.IntN(40)
		got := text.Sanitize(string(b), maxBytes)
		require.True(t, utf8.ValidString(got), "%q", got)
		require.False(t, strings.ContainsRune(got, 0), "%q", got)
		require.True(t, text.Storable(got), "%q", got)
		require.Equal(t, utf8.Valid(b) && !strings.ContainsRune(string(b), 0), text.Storable(string(b)), "%q", b)
		if maxBytes > 0 {
			require.LessOrEqual(t, len(got), maxBytes, "%q", got)
		}
	}
}

func TestStorable(t *testing.T) {
	t.Parallel()
	for s, want := range map[string]bool{"": true, "key-1": true, "é✓": true, "a\x00b": false, "\xff": false, "a\xc3": false} {
		require.Equal(t, want, text.Storable(s), "%q", s)
	}
}

// Clip never cuts a character in half, and the result with its ellipsis is at most
// n bytes plus the ellipsis.
func TestClip(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in   string
		n    int
		want string
	}{
		{"short", 10, "short"},
		{"exactly", 7, "exactly"},
		{"0123456789", 4, "0123…"},
		{"ab✓✓", 3, "ab…"}, // ✓ is 3 bytes: cutting at 3 would split it
		{"ab✓✓", 5, "ab✓…"},
		{"ééé", 1, "…"},
		{"abc", 0, "…"},
	} {
		require.Equal(t, tc.want, text.Clip(tc.in, tc.n), "%q %d", tc.in, tc.n)
	}
	r := rand.New(rand.NewPCG(5, 6))
	alphabet := []string{"a", "é", "✓", "\U0001F600"}
	for range 5000 {
		var s string
		for range r.IntN(20) {
			s += alphabet[r.IntN(len(alphabet))]
		}
		n := r.IntN(30)
		got := text.Clip(s, n)
		require.True(t, utf8.ValidString(got), "%q %d: %q", s, n, got)
		require.True(t, strings.HasPrefix(s, strings.TrimSuffix(got, "…")), "%q %d: %q", s, n, got)
		require.LessOrEqual(t, len(strings.TrimSuffix(got, "…")), n)
	}
}
