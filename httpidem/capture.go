package httpidem

import (
	"bufio"
	"bytes"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strconv"

	"github.com/idemkit/idem/internal/inboxdb"
)

// recorder holds a handler's response until the transaction has committed: the
// client must never see an answer whose work might still roll back.
type recorder struct {
	under    http.ResponseWriter
	header   http.Header
	status   int
	body     bytes.Buffer
	limit    int
	overflow bool
}

func (rec *recorder) Header() http.Header { return rec.header }

func (rec *recorder) WriteHeader(code int) {
	if code < 100 || code > 999 {
		panic(fmt.Sprintf("invalid WriteHeader code %v", code)) // as net/http does
	}
	if rec.status != 0 || code < 200 {
		return // a second call is ignored; 1xx hints are not held back for later
	}
	rec.status = code
}

func (rec *recorder) Write(p []byte) (int, error) {
	if rec.status == 0 {
		rec.WriteHeader(http.StatusOK)
	}
	if rec.overflow || rec.body.Len()+len(p) > rec.limit {
		rec.overflow = true
		rec.body.Reset()
		return len(p), nil // keep the handler going; it is answered 500 at the end
	}
	return rec.body.Write(p)
}

// WriteString lets io.WriteString avoid a copy.
func (rec *recorder) WriteString(s string) (int, error) {
	if rec.status == 0 {
		rec.WriteHeader(http.StatusOK)
	}
	if rec.overflow || rec.body.Len()+len(s) > rec.limit {
		rec.overflow = true
		rec.body.Reset()
		return len(s), nil
	}
	return rec.body.WriteString(s)
}

// Flush does nothing: the response goes out after the commit.
func (rec *recorder) Flush() {}

// FlushError is what http.ResponseController.Flush calls; it flushes nothing.
func (rec *recorder) FlushError() error { return nil }

// Hijack is refused.
func (rec *recorder) Hijack() (net.Conn, *bufio.ReadWriter, error) { return nil, nil, ErrHijack }

// Unwrap gives http.ResponseController the connection's writer for deadlines.
// Flush and Hijack are answered here first, so they never reach it.
func (rec *recorder) Unwrap() http.ResponseWriter { return rec.under }

// response returns what the handler answered, with a Content-Type sniffed as
// net/http would, so that the first answer and every replay carry the same one.
func (rec *recorder) response() *Response {
	if rec.status == 0 {
		rec.status = http.StatusOK
	}
	body := rec.body.Bytes()
	if _, set := rec.header["Content-Type"]; !set && len(body) > 0 && bodyAllowed(rec.status) && rec.header.Get("Content-Encoding") == "" {
		rec.header.Set("Content-Type", http.DetectContentType(body))
	}
	return &Response{Status: rec.status, Header: rec.header, Body: body}
}

// bodyAllowed reports whether a status may carry a body (RFC 9110).
func bodyAllowed(status int) bool {
	return status >= 200 && status != http.StatusNoContent && status != http.StatusNotModified
}

// writeResponse sends resp: its headers replace those of the same name already on
// w (set by middleware outside idem), Content-Length is set from the body.
func writeResponse(w http.ResponseWriter, resp *Response, replayed bool) {
	h := w.Header()
	for name, values := range resp.Header {
		h[name] = values
	}
	h.Del("Content-Length")
	h.Del("Transfer-Encoding")
	if bodyAllowed(resp.Status) {
		h.Set("Content-Length", strconv.Itoa(len(resp.Body)))
	}
	if replayed {
		h.Set(ReplayedHeader, "true")
	}
	w.WriteHeader(resp.Status)
	if bodyAllowed(resp.Status) {
		_, _ = w.Write(resp.Body)
	}
}

// storedNames is an allow-list of stored headers as AppendHeader takes it:
// canonical, sorted, unique.
func storedNames(allow []string) []string {
	names := make([]string, 0, len(allow))
	for _, name := range allow {
		names = append(names, http.CanonicalHeaderKey(name))
	}
	slices.Sort(names)
	return slices.Compact(names)
}

// toStoredResponse is what is stored of resp, with the headers named in names
// (storedNames) and its body.
func toStoredResponse(resp *Response, names []string) *storedResponse {
	return &storedResponse{Status: resp.Status, headerLines: inboxdb.AppendHeader(nil, resp.Header, names), Body: resp.Body}
}
