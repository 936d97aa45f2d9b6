package failgroup_test

import (
	"context"
	"encoding/hex"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/failgroup"
	"github.com/idemkit/idem/internal/pgtest"
)

func TestMask(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ in, want string }{
		{"order 42 not found", "order <n> not found"},
		{"order 1234567890 not found", "order <n> not found"},
		{"amount 12.50 exceeds limit 1e6", "amount <n> exceeds limit <n>"},
		{`provider said: 422 {"field":"currency","value":"XBT"}`, `provider said: <n> {"…":"…","…":"…"}`},
		{"user 'alice' is locked", "user '…' is locked"},
		{"key `pay_789` taken", "key `…` taken"},
		{"payment 0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b rejected", "payment <uuid> rejected"},
		{"payment 0190A1B2C3D47E5F8A9B0C1D2E3F4A5B rejected", "payment <uuid> rejected"},
		{"trace 4bf92f3577b34da6 at 0xC0FFEE", "trace <hex> at <hex>"},
		{"receipt:pay_789 dead", "receipt:pay_<n> dead"},
		{"deadbeef stays a word", "deadbeef stays a word"},
		{"  many\n\tspaces  ", "many spaces"},
		{"nul\x00 and \xff", `nul\x<n> and \xff`},
		{"", ""},
	} {
		require.Equal(t, tc.want, failgroup.Mask(tc.in), "Mask(%q)", tc.in)
	}
	// Two failures of one bug mask the same; two bugs do not.
	require.Equal(t, failgroup.Mask(`charge ch_123 for "bob": amount 10 > 5`), failgroup.Mask(`charge ch_98765 for "carol": amount 7 > 3`))
	require.NotEqual(t, failgroup.Mask("currency not supported"), failgroup.Mask("card declined"))
}

func TestMaskClips(t *testing.T) {
	t.Parallel()
	m := failgroup.Mask(strings.Repeat("é", 2000))
	require.True(t, utf8.ValidString(m))
	require.LessOrEqual(t, len(m), failgroup.MaxMasked+len("…"))
}

// TestGroupSQL: the group ID is 8 bytes, the same for the same four parts, and
// different when any part differs, including when the parts only shift a boundary.
func TestGroupSQL(t *testing.T) {
	t.Parallel()
	db, _ := pgtest.Setup(t)
	id := func(place, tenant string, code *string, masked string) string {
		var b []byte
		require.NoError(t, db.QueryRow(context.Background(), `SELECT `+failgroup.GroupSQL("$1::text", "$2::text", "$3::text", "$4::text"),
			place, tenant, code, masked).Scan(&b))
		require.Len(t, b, 8)
		return hex.EncodeToString(b)
	}
	code := "bad_payload"
	empty := ""
	a := id("orders", "", &code, "order <n> not found")
	require.Equal(t, a, id("orders", "", &code, "order <n> not found"))
	require.Equal(t, id("orders", "", nil, "x"), id("orders", "", &empty, "x"), "a NULL code counts as empty")
	for _, other := range []string{
		id("orders2", "", &code, "order <n> not found"),
		id("orders", "t1", &code, "order <n> not found"),
		id("orders", "", &empty, "order <n> not found"),
		id("orders", "", &code, "order <n> found"),
		id("order", "s", &code, "order <n> not found"),
	} {
		require.NotEqual(t, a, other)
	}
}
