package inbox_test

import (
	"bytes"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/inbox"
)

func TestCanonicalJSON(t *testing.T) {
	t.Parallel()
	fp := inbox.CanonicalJSON(inbox.JSONOptions{})
	a, err := fp([]byte(`{"b":2,"a":{"y":1e2,"x":"é"}}`))
	require.NoError(t, err)
	b, err := fp([]byte("{ \"a\" : { \"x\": \"\\u00e9\", \"y\": 100 },\n \"b\": 2.0 }"))
	require.NoError(t, err)
	require.Equal(t, a, b, "key order, whitespace, escapes and number form do not count")

	c, err := fp([]byte(`{"b":3,"a":{"y":100,"x":"é"}}`))
	require.NoError(t, err)
	require.NotEqual(t, a, c)

	_, err = fp([]byte(`{"a":`))
	require.ErrorIs(t, err, inbox.ErrNotJSON)
	require.True(t, inbox.IsPermanent(err))
	_, err = fp([]byte(`not json`))
	require.ErrorIs(t, err, inbox.ErrNotJSON)
}

func TestCanonicalJSONFieldSelection(t *testing.T) {
	t.Parallel()
	incl := inbox.CanonicalJSON(inbox.JSONOptions{Include: []string{"order.id", "amount"}})
	a, err := incl([]byte(`{"order":{"id":7,"note":"x"},"amount":5,"sent_at":"10:00"}`))
	require.NoError(t, err)
	b, err := incl([]byte(`{"amount":5,"order":{"id":7,"note":"y"},"sent_at":"10:01"}`))
	require.NoError(t, err)
	require.Equal(t, a, b, "only included fields count")

	excl := inbox.CanonicalJSON(inbox.JSONOptions{Exclude: []string{"sent_at", "meta.trace"}})
	a, err = excl([]byte(`{"id":1,"sent_at":"a","meta":{"trace":"t1","v":1}}`))
	require.NoError(t, err)
	b, err = excl([]byte(`{"meta":{"v":1,"trace":"t2"},"id":1,"sent_at":"b"}`))
	require.NoError(t, err)
	require.Equal(t, a, b, "excluded fields do not count")
	c, err := excl([]byte(`{"id":2,"sent_at":"a","meta":{"trace":"t1","v":1}}`))
	require.NoError(t, err)
	require.NotEqual(t, a, c)
}

func TestSHA256IsRawBytes(t *testing.T) {
	t.Parallel()
	a, _ := inbox.SHA256([]byte(`{"a":1,"b":2}`))
	b, _ := inbox.SHA256([]byte(`{"b":2,"a":1}`))
	require.NotEqual(t, a, b, "the default fingerprint is the raw payload")
	require.Len(t, a, 32)
}

// FuzzCanonicalize: canonicalizing twice equals canonicalizing once, and an object
// with its keys reordered gets the same fingerprint.
func FuzzCanonicalize(f *testing.F) {
	for _, s := range []string{`{"b":1,"a":[1,2,{"d":null,"c":true}]}`, `[1e3, -0, 0.1]`, `"x"`, `{"é":"\u00e9"}`, `{}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		once, err := inbox.Canonicalize(in, inbox.JSONOptions{})
		if err != nil {
			return
		}
		twice, err := inbox.Canonicalize(once, inbox.JSONOptions{})
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
		reordered, err := inbox.Canonicalize(buf.Bytes(), inbox.JSONOptions{})
		if err != nil {
			t.Fatalf("reordered %q: %v", buf.Bytes(), err)
		}
		if !bytes.Equal(once, reordered) {
			t.Fatalf("reordering changed the canonical form: %q vs %q", once, reordered)
		}
	})
}
