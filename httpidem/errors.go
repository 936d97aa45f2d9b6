package httpidem

// Error is an httpidem error with a stable code, for logs and metrics; callers
// compare with errors.Is against the sentinels below.
type Error struct {
	code string
	msg  string
}

func (e *Error) Error() string { return "idem: " + e.msg }

// Code is the stable machine-readable code, such as "scope_not_chosen".
func (e *Error) Code() string { return e.code }

// Config errors: New wraps them with what it found.
var (
	// ErrScopeNotChosen: the Config sets neither Tenant nor Unscoped, or both. Keys
	// are scoped to a tenant, or shared by every client on purpose; never by
	// default, since without a scope a client that presents another client's key
	// and request gets that client's stored answer.
	ErrScopeNotChosen = &Error{code: "scope_not_chosen", msg: "choose the key scope: set Config.Tenant to return the authenticated principal's tenant, " +
		"or Config.Unscoped = true if every client may get every other client's stored answers"}
	// ErrSensitiveHeader: StoredHeaders names a header that carries credentials
	// (SensitiveHeaders) and StoreSensitiveHeaders is not set.
	ErrSensitiveHeader = &Error{code: "sensitive_header_stored", msg: "StoredHeaders names a header that carries credentials, which would be replayed to every retry " +
		"with the key until it expires; remove it, or set Config.StoreSensitiveHeaders = true"}
)
