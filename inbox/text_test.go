package inbox_test

import (
	"context"
	"math/rand/v2"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/inbox"
)

func TestSanitizeText(t *testing.T) {
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
		got := inbox.SanitizeText(tc.in, tc.max)
		require.Equal(t, tc.want, got, "%q max %d", tc.in, tc.max)
	}
}

// Whatever the input, the result is text Postgres takes, within the limit.
func TestSanitizeTextAnyBytes(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(1, 2))
	for range 20000 {
		b := make([]byte, r.IntN(64))
		for i := range b {
			b[i] = byte(r.IntN(256))
		}
		maxBytes := r.IntN(40)
		got := inbox.SanitizeText(string(b), maxBytes)
		require.True(t, utf8.ValidString(got), "%q", got)
		require.False(t, strings.ContainsRune(got, 0), "%q", got)
		if maxBytes > 0 {
			require.LessOrEqual(t, len(got), maxBytes, "%q", got)
		}
	}
}

// TestFailStoresAnyBytes: the store records a permanent failure whatever bytes its
// code and error hold (a handler may quote a binary body, a panic value may be
// anything), in FailTx and in FailLease. (Before, Postgres refused the row with
// 22021 and the failure was never recorded.)
func TestFailStoresAnyBytes(t *testing.T) {
	ctx := context.Background()
	store, b := setup(t)
	pool := b.pool.(inbox.DBTX)
	const junk = "upstream said \x00\xff\xfe"
	res, err := store.FailTx(ctx, pool, claimOf("f", "fp"), "code\x00", junk)
	require.NoError(t, err)
	require.True(t, res.Claimed)
	rec, err := store.Get(ctx, pool, inbox.ID{Consumer: "c", Key: "f"})
	require.NoError(t, err)
	require.Equal(t, `code\x00`, rec.ErrorCode)
	require.Equal(t, `upstream said \x00\xff\xfe`, rec.Error)

	lease, err := store.Lease(ctx, pool, claimOf("l", "fp"), time.Minute)
	require.NoError(t, err)
	id := inbox.ID{Consumer: "c", Key: "l"}
	require.NoError(t, store.FailLease(ctx, pool, id, lease.Fence, time.Hour, "permanent", junk))
	rec, err = store.Get(ctx, pool, id)
	require.NoError(t, err)
	require.Equal(t, inbox.StateFailed, rec.State)
	require.Equal(t, `upstream said \x00\xff\xfe`, rec.Error)
}
