package inbox_test

import (
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

func TestCanonicalJSONExactNumbers(t *testing.T) {
	t.Parallel()
	for _, opts := range []inbox.JSONOptions{{}, {Include: []string{"amount"}}, {Exclude: []string{"note"}}} {
		fp := inbox.CanonicalJSON(opts)
		for _, pair := range [][2]string{
			{"9007199254740993", "9007199254740992"}, // 2^53 + 1 and 2^53
			{"12345678901234567890123", "12345678901234567890124"},
			{"0.10000000000000001", "0.1"},
			{"1.0000000000000000000001", "1"},
			{"100000000000000000000000000001e-5", "100000000000000000000000000000e-5"},
			{"-9223372036854775809", "-9223372036854775808"},
			{"1e400", "1e401"}, // beyond a double's range: JCS refused both
			{"1e-400", "0"},
		} {
			a, err := fp([]byte(`{"amount":` + pair[0] + `,"note":"x"}`))
			require.NoError(t, err, pair[0])
			b, err := fp([]byte(`{"amount":` + pair[1] + `,"note":"x"}`))
			require.NoError(t, err, pair[1])
			require.NotEqual(t, a, b, "%s and %s are different amounts (options %+v)", pair[0], pair[1], opts)
		}
	}
}
