package httpidem

import "net/http"

// SetAfterCommit sets a function that runs after each commit and before the answer
// is written: the crash test kills the server there.
func SetAfterCommit(m *Middleware, f func(r *http.Request)) {
	for _, e := range m.parts.Parts() {
		e.afterCommit = f
	}
}

// SetOnLeaseWait sets a function that runs when a lease-mode request finds the key
// held and starts to wait.
func SetOnLeaseWait(m *Middleware, f func(r *http.Request)) {
	for _, e := range m.parts.Parts() {
		e.onLeaseWait = f
	}
}

// ParseKey is parseKey, for the key syntax tests.
var ParseKey = parseKey

// DefaultFingerprint is the default fingerprint over opts (Config.Fields), for
// tests that compute a key's fingerprint or wrap the default.
var DefaultFingerprint = defaultFingerprint
