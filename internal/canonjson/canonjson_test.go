package canonjson_test

import (
	"bytes"
	"encoding/json"
	"math"
	"math/big"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/gowebpki/jcs"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/canonjson"
)

// FuzzCanonicalize: canonicalizing twice equals canonicalizing once, an object
// with its keys reordered gets the same fingerprint, everything JCS accepts is
// accepted, and the output differs from JCS's only in numbers, by digits a double
// cannot hold (JCS of our output equals JCS of the input).
func FuzzCanonicalize(f *testing.F) {
	for _, s := range []string{`{"b":1,"a":[1,2,{"d":null,"c":true}]}`, `[1e3, -0, 0.1]`, `"x"`, `{"é":"\u00e9"}`, `{}`,
		`{"amount":9007199254740993}`, `[0.10000000000000001, 1E400, -0.0e-7, 123456789012345678901234567890]`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		once, err := canonjson.Canonicalize(in, canonjson.Options{})
		viaJCS, jcsErr := jcs.Transform(in)
		if jcsErr == nil && err != nil {
			t.Fatalf("JCS accepts %q, Canonicalize refuses it: %v", in, err)
		}
		if err != nil {
			return
		}
		if jcsErr == nil {
			again, err := jcs.Transform(once)
			if err != nil || !bytes.Equal(again, viaJCS) {
				t.Fatalf("%q: JCS of our form %q is %q (%v), JCS of the input is %q", in, once, again, err, viaJCS)
			}
		}
		twice, err := canonjson.Canonicalize(once, canonjson.Options{})
		if err != nil {
			t.Fatalf("canonical output %q does not canonicalize: %v", once, err)
		}
		if !bytes.Equal(once, twice) {
			t.Fatalf("not idempotent: %q then %q", once, twice)
		}
		// Reverse the top-level keys of an object: same canonical form.
		var obj map[string]json.RawMessage
		if json.Unmarshal(once, &obj) != nil || len(obj) < 2 {
			return
		}
		keys := make([]string, 0, len(obj))
		for k := range obj {
			keys = append(keys, k)
		}
		var buf bytes.Buffer
		buf.WriteByte('{')
		for i := len(keys) - 1; i >= 0; i-- {
			kb, _ := json.Marshal(keys[i])
			buf.Write(kb)
			buf.WriteByte(':')
			buf.Write(obj[keys[i]])
			if i > 0 {
				buf.WriteByte(',')
			}
		}
		buf.WriteByte('}')
		reordered, err := canonjson.Canonicalize(buf.Bytes(), canonjson.Options{})
		if err != nil {
			t.Fatalf("reordered %q: %v", buf.Bytes(), err)
		}
		if !bytes.Equal(once, reordered) {
			t.Fatalf("reordering changed the canonical form: %q vs %q", once, reordered)
		}
	})
}

// TestCanonicalJSONExactNumbers: numbers that a double cannot hold do not
// fingerprint the same as their neighbours (with RFC 8785's double semantics, a
// changed amount would pass as a duplicate).
// TestCanonicalNumberForms pins what is equal: the exact decimal value decides,
// and the layout is JCS's.
func TestCanonicalNumberForms(t *testing.T) {
	t.Parallel()
	for want, forms := range map[string][]string{
		"1":                             {"1", "1.0", "1e0", "1E0", "1e+0", "10e-1", "0.1e1", "1.000", "100e-2", "0.00001e5"},
		"0":                             {"0", "-0", "0.0", "-0.0", "0e5", "-0E-5", "0.000e99"},
		"1.5":                           {"1.5", "1.50", "15e-1", "0.15e1"},
		"-1.5":                          {"-1.5", "-1.50", "-15E-1"},
		"100":                           {"100", "1e2", "1E+2", "100.0", "0.1e3"},
		"100000000000000000000":         {"1e20", "100000000000000000000"},
		"1e+21":                         {"1e21", "1000000000000000000000", "10e20"},
		"0.000001":                      {"1e-6", "0.000001", "0.0000010"},
		"1e-7":                          {"1e-7", "0.0000001", "10e-8"},
		"9007199254740993":              {"9007199254740993", "9007199254740993.0", "9.007199254740993e15"},
		"1.2345678901234568e+23":        {"1.2345678901234568e23"},
		"1.23456789012345678901234e+23": {"123456789012345678901234"},
		"0.10000000000000001":           {"0.10000000000000001", "1.0000000000000001e-1"},
		"5e-324":                        {"5e-324", "0.5e-323"},
		"-1e+400":                       {"-1e400", "-10e399"},
		"1e+1000000000000000000000":     {"1e1000000000000000000000", "0.1e1000000000000000000001"},
		"1.5e-1000000000000000000000":   {"15e-1000000000000000000001"},
	} {
		for _, form := range forms {
			got, err := canonjson.Canonicalize([]byte(form), canonjson.Options{})
			require.NoError(t, err, form)
			require.Equal(t, want, string(got), "canonical form of %s", form)
		}
	}
	for _, bad := range []string{"01", "-", "1.", ".5", "1e", "1e+", "+1", "0x10", "1_000", "NaN", "Infinity", "--1", "1.5.2", "1e5e5"} {
		_, err := canonjson.Canonicalize([]byte(bad), canonjson.Options{})
		require.ErrorIs(t, err, canonjson.ErrNotJSON, bad)
	}
}

// TestCanonicalJSONStrict: what JCS refuses, and duplicate names whatever the
// field selection.
func TestCanonicalJSONStrict(t *testing.T) {
	t.Parallel()
	for _, bad := range []string{`{"a":1,"a":2}`, `{"a":1,"\u0061":1}`, "\"\xff\"", `"\ud800"`, `"\udc00x"`,
		`"\ud800\u0041"`, "\"a\x01\"", `[1,]`, `{"a":1,}`, `{"a" 1}`, `[1 2]`, `tru`, `nul`, `{} {}`, ``, ` `, `"\x"`,
		strings.Repeat("[", canonjson.MaxDepth+1) + strings.Repeat("]", canonjson.MaxDepth+1)} {
		for _, opts := range []canonjson.Options{{}, {Include: []string{"a"}}} {
			_, err := canonjson.Canonicalize([]byte(bad), opts)
			require.ErrorIs(t, err, canonjson.ErrNotJSON, "%q", bad)
		}
	}
	got, err := canonjson.Canonicalize([]byte(` {"\u20ac":"\u0000\/\u001f\u007f", "\ud83d\ude00":[true,false,null], "a":{}} `), canonjson.Options{})
	require.NoError(t, err)
	require.Equal(t, "{\"a\":{},\"€\":\"\\u0000/\\u001f\x7f\",\"😀\":[true,false,null]}", string(got))
}

// FuzzCanonicalNumbers: two numbers canonicalize the same exactly when their
// decimal values are equal, and every number a double holds in its shortest form
// comes out as JCS writes it.
func FuzzCanonicalNumbers(f *testing.F) {
	f.Add("9007199254740993", "9007199254740992", 1.5)
	f.Add("1.0", "1e0", 1e21)
	f.Add("-0", "0.0", 5e-324)
	f.Add("0.10000000000000001", "0.1", -1.7976931348623157e308)
	f.Fuzz(func(t *testing.T, a, b string, x float64) {
		if hugeExponent(a) || hugeExponent(b) {
			return // big.Rat would build the whole power of ten
		}
		ca, errA := canonjson.Canonicalize([]byte(a), canonjson.Options{})
		cb, errB := canonjson.Canonicalize([]byte(b), canonjson.Options{})
		ra, okA := exactValue(a)
		rb, okB := exactValue(b)
		for _, c := range []struct {
			in  string
			err error
			ok  bool
		}{{a, errA, okA}, {b, errB, okB}} {
			if c.ok && c.err != nil || c.err == nil && !c.ok && looksNumeric(c.in) {
				t.Fatalf("%q: %v, but by the grammar valid = %v", c.in, c.err, c.ok)
			}
		}
		if okA && okB && bytes.Equal(ca, cb) != (ra.Cmp(rb) == 0) {
			t.Fatalf("%q -> %s and %q -> %s, but their values are equal: %v", a, ca, b, cb, ra.Cmp(rb) == 0)
		}
		if okA {
			if r, ok := exactValue(string(ca)); !ok || r.Cmp(ra) != 0 {
				t.Fatalf("%q -> %s changed the value", a, ca)
			}
		}
		if math.IsInf(x, 0) || math.IsNaN(x) {
			return
		}
		want, err := jcs.NumberToJSON(x)
		require.NoError(t, err)
		for _, form := range []string{strconv.FormatFloat(x, 'g', -1, 64), strconv.FormatFloat(x, 'e', -1, 64), strconv.FormatFloat(x, 'f', -1, 64)} {
			got, err := canonjson.Canonicalize([]byte(form), canonjson.Options{})
			require.NoError(t, err, form)
			if string(got) != want {
				t.Fatalf("%s: got %s, JCS writes %s", form, got, want)
			}
		}
	})
}

// jsonNumber is RFC 8259's number grammar, for the oracle.
var jsonNumber = regexp.MustCompile(`^-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?$`)

// exactValue is the number's value as a fraction, or false if s is not an RFC 8259
// number.
func exactValue(s string) (*big.Rat, bool) {
	s = strings.Trim(s, " \t\n\r")
	if !jsonNumber.MatchString(s) {
		return nil, false
	}
	r, ok := new(big.Rat).SetString(s)
	return r, ok
}

func looksNumeric(s string) bool {
	s = strings.Trim(s, " \t\n\r")
	return s != "" && (s[0] == '-' || s[0] >= '0' && s[0] <= '9')
}

func hugeExponent(s string) bool {
	i := strings.IndexAny(s, "eE")
	if i < 0 {
		return false
	}
	e, err := strconv.Atoi(strings.TrimLeft(s[i+1:], "+-"))
	return err != nil || e > 5000
}
