package httpidem

import "github.com/idemkit/idem/internal/errcode"

// Errors, each an *errcode.Error with a stable code (inbox.Code reads it); compare
// with errors.Is. New wraps the config errors with what it found.
var (
	// ErrInvalidConfig is wrapped by the error New returns for a config it refuses
	// (code "invalid_config"), unless a more specific sentinel below says what is
	// wrong. Every idem package has the same value.
	ErrInvalidConfig = errcode.ErrInvalidConfig
	// ErrScopeNotChosen is returned when the Config sets neither Tenant nor
	// Unscoped, or both. Keys are scoped to a tenant, or shared by every client on
	// purpose; never by default, since without a scope a client that presents
	// another client's key and request gets that client's stored answer.
	ErrScopeNotChosen = errcode.Permanent("scope_not_chosen", "choose the key scope: set Config.Tenant to return the authenticated principal's tenant, "+
		"or Config.Unscoped = true if every client may get every other client's stored answers")
	// ErrSensitiveHeader is returned when StoredHeaders names a header that carries
	// credentials (Authorization, Proxy-Authorization, Cookie, Set-Cookie,
	// Set-Cookie2, Authentication-Info, Proxy-Authentication-Info) and
	// StoreSensitiveHeaders is not set.
	ErrSensitiveHeader = errcode.Permanent("sensitive_header_stored", "StoredHeaders names a header that carries credentials, which would be replayed to every retry "+
		"with the key until it expires; remove it, or set Config.StoreSensitiveHeaders = true")

	// ErrNoTx is what Tx panics with, and TxSafely returns, for a context without
	// httpidem's transaction. Its code is the consumer's for the same mistake.
	ErrNoTx = errcode.Transient("no_transaction", "no httpidem transaction in this context: httpidem's middleware is not around this handler (wrap it: mux.Handle(pattern, idem.Middleware(h))), "+
		"or the request passed through untouched (a safe method), or ctx is not the request's (r.Context()); use httpidem.TxSafely where no transaction is expected")
	// ErrTxOwned is returned when the handler calls Commit or Rollback on the
	// transaction idem gave it. Its code is the consumer's for the same mistake.
	ErrTxOwned = errcode.Transient("tx_owned", "the request's transaction belongs to httpidem: answer with a final status to commit, with any other status to roll back")
	// ErrHijack is returned by Hijack: a handler behind idem cannot hijack the
	// connection, because its response is held until the commit.
	ErrHijack = errcode.Permanent("hijack_refused", "a handler behind httpidem cannot hijack the connection (its response is held until the commit)")
)
