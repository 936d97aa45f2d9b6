package canonjson

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"
)

// canonicalSeeds are inputs on both sides of IsCanonical's line.
var canonicalSeeds = []string{
	`{"amount":123}`, `{"a":1,"b":[true,false,null],"c":{"d":"x\ny\"z\\"}}`, `[]`, `{}`, `"é"`, `0`, `-5`,
	`12.5`, `0.5`, `-0.000001`, `0.0000001`, `1.50`, `-0`, `1e3`, `1E3`, `100000000000000000000`,
	`1000000000000000000000`, `{"b":1,"a":2}`, `{"a":1,"a":2}`, `{"a":1 }`, ` 1`, `"\/"`, `"\u0001"`,
	`"\u00e9"`, `{"é":1}`, `{"a\"b":1}`, `[1,]`, `{"a":}`, `"\xff"`, "\"\xed\xa0\x80\"", `"\t"`, "\"\t\"",
	`01`, `-`, `1.`, `.5`, `truex`, `[1][2]`, `{"":1,"a":2}`, `{"a":1,"":2}`, `{"a":{"b":1,"c":[{"d":2}]}}`,
}

// TestIsCanonical: what IsCanonical accepts, Canonicalize (without its shortcut)
// returns unchanged; and it accepts the compact, sorted bodies it is there for.
func TestIsCanonical(t *testing.T) {
	for _, s := range canonicalSeeds {
		checkCanonical(t, []byte(s))
	}
	for _, s := range []string{`{"amount":123}`, `{"a":1,"b":[true,false,null],"c":{"d":"x\ny\"z\\"}}`, `"é"`,
		`12.5`, `0.5`, `-0.000001`, `100000000000000000000`, `{"":1,"a":2}`} {
		require.True(t, IsCanonical([]byte(s)), s)
	}
	for _, s := range []string{`1.50`, `-0`, `1e3`, `{"b":1,"a":2}`, `{"a":1,"a":2}`, `{"a":1 }`, `"\/"`,
		`1000000000000000000000`, `0.0000001`} {
		require.False(t, IsCanonical([]byte(s)), s)
	}
	in := []byte(`{"amount":123,"currency":"EUR","items":[{"sku":"a","qty":2}]}`)
	require.Zero(t, testing.AllocsPerRun(100, func() { IsCanonical(in) }), "IsCanonical allocates nothing")
}

// FuzzIsCanonical: whatever IsCanonical accepts is JSON that Canonicalize,
// without its shortcut, returns byte for byte.
func FuzzIsCanonical(f *testing.F) {
	for _, s := range canonicalSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		checkCanonical(t, in)
		if out, err := canonicalize(in, Options{}); err == nil {
			checkCanonical(t, out)
		}
	})
}

func checkCanonical(t *testing.T, in []byte) {
	t.Helper()
	if !IsCanonical(in) {
		return
	}
	out, err := canonicalize(in, Options{})
	if err != nil {
		t.Fatalf("IsCanonical accepts %q, which is not JSON: %v", in, err)
	}
	if !bytes.Equal(out, in) {
		t.Fatalf("IsCanonical accepts %q, whose canonical form is %q", in, out)
	}
}
