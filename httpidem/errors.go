package httpidem

import "github.com/idemkit/idem/internal/errcode"

// Error is an idem error with a stable code, such as "scope_not_chosen", for logs
// and metrics; callers compare with errors.Is against the sentinels below. It is
// the one coded error type of every idem package (inbox.Error is the same type).
type Error = errcode.Error

// Config errors: New wraps them with what it found.
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
	// credentials (SensitiveHeaders) and StoreSensitiveHeaders is not set.
	ErrSensitiveHeader = errcode.Permanent("sensitive_header_stored", "StoredHeaders names a header that carries credentials, which would be replayed to every retry "+
		"with the key until it expires; remove it, or set Config.StoreSensitiveHeaders = true")
)
