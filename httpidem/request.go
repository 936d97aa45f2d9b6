package httpidem

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"github.com/dunglas/httpsfv"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/canonjson"
)

// errKeyAbsent: the request has no key header.
var errKeyAbsent = errors.New("no key header")

// parseKey reads the key from the request's header values. One value is allowed.
// A value that starts with a double quote is parsed as an RFC 9651 Structured
// Field Item (the draft's form: an sf-string, with parameters that are ignored):
// its value must be a String, whose quotes and escapes (\" and \\) go, and which
// holds only printable ASCII. Anything else is the key as it is.
func parseKey(values []string) (string, error) {
	switch len(values) {
	case 0:
		return "", errKeyAbsent
	case 1:
	default:
		return "", fmt.Errorf("%d key headers; send one", len(values))
	}
	v := strings.Trim(values[0], " \t")
	if !strings.HasPrefix(v, `"`) {
		return v, inbox.ValidateKey(v)
	}
	item, err := httpsfv.UnmarshalItem([]string{v})
	if err != nil {
		return "", errors.New(`a quoted key must be a Structured Field String, such as "8e03978e-40d5-43e8-bc93-6894a57f9324", with parameters after it if any (;name=value)`)
	}
	key, ok := item.Value.(string)
	if !ok { // unreachable: a value that starts with a quote parses as a String or fails
		return "", errors.New("a quoted key must be a Structured Field String")
	}
	return key, inbox.ValidateKey(key)
}

// errBodyTooLarge: the body is over the limit.
var errBodyTooLarge = errors.New("request body too large")

// readBody reads the whole body, up to limit bytes, into one buffer: of the
// declared Content-Length (and a byte to see the end), or growing from 512 bytes.
func readBody(r *http.Request, limit int64) ([]byte, error) {
	if r.ContentLength > limit {
		return nil, errBodyTooLarge
	}
	if r.Body == nil || r.Body == http.NoBody {
		return nil, nil
	}
	size := int64(512)
	if r.ContentLength > 0 {
		size = r.ContentLength + 1
	}
	body := make([]byte, 0, min(size, limit+1))
	for {
		if len(body) == cap(body) {
			body = append(body, 0)[:len(body)] // grow
		}
		n, err := r.Body.Read(body[len(body):min(cap(body), int(limit)+1)])
		body = body[:len(body)+n]
		if int64(len(body)) > limit {
			return nil, errBodyTooLarge
		}
		if err == io.EOF {
			return body, nil
		}
		if err != nil {
			return nil, err
		}
	}
}

// defaultFingerprint returns the default fingerprint: sha256 over the method, the
// escaped path, the query (its parameters sorted by name) and the body. A body that
// is JSON counts by its canonical form with exact numbers (canonjson.Canonicalize, with
// the fields chosen by opts), whatever its Content-Type says (curl -d sends JSON as
// a form); a body that declares a JSON media type and is not JSON is an error
// (inbox.ErrNotJSON); a form (application/x-www-form-urlencoded) counts by its fields
// sorted by name; any other body counts byte for byte, with its media type.
// Headers never count: not Authorization, not the key, not a trace ID.
//
// The path is there because the operation is the route template: POST
// /accounts/1/payments and POST /accounts/2/payments are one operation, and the
// same key and body on both are two different commands.
func defaultFingerprint(opts inbox.JSONOptions) func(r *http.Request, body []byte) ([]byte, error) {
	selects := len(opts.Include) > 0 || len(opts.Exclude) > 0
	return func(r *http.Request, body []byte) ([]byte, error) {
		// The fields are laid out in one buffer and hashed at once. Each is
		// "<length>:<bytes>\x00". The form is part of every stored key: it must never
		// change (TestDefaultFingerprintIsStable).
		buf := make([]byte, 0, 128+len(r.URL.RawPath)+len(r.URL.Path)+len(r.URL.RawQuery)+len(body))
		buf = appendField(buf, "idem-http-1")
		buf = appendField(buf, r.Method)
		buf = appendField(buf, r.URL.EscapedPath())
		buf = appendField(buf, sortedQuery(r.URL.RawQuery))
		if len(body) == 0 {
			buf = appendField(buf, "empty")
			return sum(buf), nil
		}
		if !selects && canonjson.IsCanonical(body) { // already canonical: no parse tree
			buf = appendField(buf, "json")
			return sum(appendField(buf, body)), nil
		}
		canon, err := canonjson.Canonicalize(body, canonjson.Options(opts))
		if err == nil {
			buf = appendField(buf, "json")
			return sum(appendField(buf, canon)), nil
		}
		mediaType := ""
		if ct := r.Header.Get("Content-Type"); ct != "" {
			mt, _, err := mime.ParseMediaType(ct)
			if err != nil {
				mt = strings.ToLower(strings.TrimSpace(ct))
			}
			mediaType = mt
		}
		switch {
		case mediaType == "application/json" || strings.HasSuffix(mediaType, "+json"):
			return nil, err
		case mediaType == "application/x-www-form-urlencoded":
			buf = appendField(buf, "form")
			buf = appendField(buf, sortedQuery(string(body)))
		default:
			buf = appendField(buf, "raw")
			buf = appendField(buf, mediaType)
			buf = appendField(buf, body)
		}
		return sum(buf), nil
	}
}

// appendField appends one field of the default fingerprint: its length, a colon,
// its bytes and a NUL.
func appendField[T string | []byte](buf []byte, v T) []byte {
	buf = strconv.AppendInt(buf, int64(len(v)), 10)
	buf = append(buf, ':')
	buf = append(buf, v...)
	return append(buf, 0)
}

func sum(b []byte) []byte {
	s := sha256.Sum256(b)
	return s[:]
}

// sortedQuery is a query or form with its parameters sorted by name (values keep
// their order), or the text as it is if it does not parse.
func sortedQuery(raw string) string {
	if raw == "" {
		return ""
	}
	q, err := url.ParseQuery(raw)
	if err != nil {
		return raw
	}
	return q.Encode()
}

// fingerprintView is the request a custom fingerprint sees: a clone without the
// headers that never belong in a fingerprint.
func fingerprintView(r *http.Request, keyHeader string) *http.Request {
	c := r.Clone(r.Context())
	c.Header.Del("Authorization")
	c.Header.Del("Proxy-Authorization")
	c.Header.Del("Cookie")
	c.Header.Del(keyHeader)
	c.Body = http.NoBody
	return c
}
