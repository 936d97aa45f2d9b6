package httpidem_test

import (
	"bufio"
	"bytes"
	"context"
	"net/http"
	"os/exec"
	"strings"
	"testing"

	"github.com/dunglas/httpsfv"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/httpidem"
	"github.com/idemkit/idem/inbox"
)

// TestKeySyntax: a value that starts with a double quote is an RFC 9651 Item whose
// value is a String; the key is the string and its parameters are ignored. Any
// other value is the key as it is.
func TestKeySyntax(t *testing.T) {
	t.Parallel()
	for value, want := range map[string]string{
		`"abc"`:                                "abc",
		`"abc";p=1`:                            "abc",
		`"abc";p=1;q="x";flag`:                 "abc",
		`"abc" ; p=1`:                          "", // OWS before ';' is not in the grammar
		`"abc";p=?1;d=1.5;t=tok;b=:AQ==:`:      "abc",
		`  "abc";p  `:                          "abc",
		`"a\"b\\c"`:                            `a"b\c`,
		`"a b"`:                                "a b",
		`abc`:                                  "abc",
		`abc;p=1`:                              "abc;p=1", // not quoted: the value as it is
		`8e03978e-40d5-43e8-bc93-6894a57f9324`: "8e03978e-40d5-43e8-bc93-6894a57f9324",
		`"unterminated`:                        "",
		`"a"b`:                                 "",
		`"\x"`:                                 "",
		`""`:                                   "",
		`"abc";`:                               "",
		`"abc";P=1`:                            "", // parameter names are lower case
		`"abc";p=`:                             "",
		`"abc", "def"`:                         "",
		"\"caf\xc3\xa9\"":                      "", // sf-strings are ASCII
		"\"a\tb\"":                             "",
	} {
		got, err := httpidem.ParseKey([]string{value})
		if want == "" {
			require.Error(t, err, "%q", value)
			continue
		}
		require.NoError(t, err, "%q", value)
		require.Equal(t, want, got, "%q", value)
	}
	_, err := httpidem.ParseKey([]string{`"a"`, `"b"`})
	require.ErrorContains(t, err, "2 key headers")
}

// FuzzKeySyntax: parsing never panics; a key it accepts is a valid inbox key; and
// any printable ASCII key, serialized as an sf-string with parameters by httpsfv,
// parses back to itself.
func FuzzKeySyntax(f *testing.F) {
	for _, s := range []string{`"abc";p=1`, `abc`, `"a\"b"`, `"`, `";`, "\"\x00\"", `"x";a=(1 2)`} {
		f.Add(s, "p", int64(1))
	}
	f.Fuzz(func(t *testing.T, value, param string, n int64) {
		if key, err := httpidem.ParseKey([]string{value}); err == nil {
			require.NoError(t, inbox.ValidateKey(key))
		}
		item := httpsfv.NewItem(value)
		if name := strings.ToLower(param); name != "" {
			item.Params.Add(name, n)
		}
		header, err := httpsfv.Marshal(item)
		if err != nil || inbox.ValidateKey(value) != nil {
			return // not an sf-string (or a parameter name), or not a key
		}
		got, err := httpidem.ParseKey([]string{header})
		require.NoError(t, err, "%s", header)
		require.Equal(t, value, got, "%s", header)
	})
}

// TestKeySyntaxWithCurl: what curl sends reaches the middleware as written: the
// draft's quoted form with parameters, the quoted form and the bare key are one
// key against a real server; a malformed quoted key is 400.
func TestKeySyntaxWithCurl(t *testing.T) {
	t.Parallel()
	curl, err := exec.LookPath("curl")
	require.NoError(t, err, "curl is needed for this test (apt-get install curl)")
	b := setup(t)
	post := func(key string) (int, string, string) {
		t.Helper()
		out, err := exec.CommandContext(context.Background(), curl, "-sS", "-i", b.srv.URL+"/payments",
			"-H", "Content-Type: application/json", "-H", "X-Tenant: "+defaultTenant,
			"-H", "Idempotency-Key: "+key, "-d", `{"amount": 3}`).Output()
		require.NoError(t, err, "curl")
		head, body, ok := bytes.Cut(out, []byte("\r\n\r\n"))
		require.True(t, ok, "%s", out)
		resp, err := http.ReadResponse(bufioReader(append(head, "\r\n\r\n"...)), nil)
		require.NoError(t, err)
		_ = resp.Body.Close() // only the head was parsed: closing the cut-off body reports unexpected EOF
		return resp.StatusCode, resp.Header.Get(httpidem.ReplayedHeader), string(body)
	}
	status, replayed, first := post(`"8e03978e-40d5-43e8-bc93-6894a57f9324";p=1`)
	require.Equal(t, http.StatusCreated, status, first)
	require.Empty(t, replayed)
	for _, same := range []string{`"8e03978e-40d5-43e8-bc93-6894a57f9324"`, `8e03978e-40d5-43e8-bc93-6894a57f9324`,
		`"8e03978e-40d5-43e8-bc93-6894a57f9324";p=2;trace="x"`} {
		status, replayed, body := post(same)
		require.Equal(t, http.StatusCreated, status, same)
		require.Equal(t, "true", replayed, same)
		require.Equal(t, first, body, same)
	}
	status, _, body := post(`"8e03978e-40d5-43e8-bc93-6894a57f9324";`)
	require.Equal(t, http.StatusBadRequest, status)
	require.Contains(t, body, httpidem.CodeKeyInvalid)
	require.Equal(t, 1, b.payments(t))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM inbox WHERE key = '8e03978e-40d5-43e8-bc93-6894a57f9324'`))
}

func bufioReader(b []byte) *bufio.Reader { return bufio.NewReader(bytes.NewReader(b)) }
