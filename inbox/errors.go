package inbox

import (
	"errors"
	"fmt"
)

// Error is an inbox error with a stable code. Logs and metrics use the code; callers
// compare with errors.Is against the sentinels below.
type Error struct {
	code      string
	msg       string
	permanent bool
}

func newError(code, msg string, permanent bool) *Error {
	return &Error{code: code, msg: msg, permanent: permanent}
}

func (e *Error) Error() string { return "idem: " + e.msg }

// Code is the stable machine-readable code, such as "empty_key".
func (e *Error) Code() string { return e.code }

// Permanent reports whether the same input can never succeed, so that retrying it is
// pointless. The consumer records or poisons permanent errors instead of nacking.
func (e *Error) Permanent() bool { return e.permanent }

// Sentinel errors. Each is permanent unless it says otherwise.
var (
	// ErrEmptyKey: the message gave no key.
	ErrEmptyKey = newError("empty_key", "empty idempotency key", true)
	// ErrKeyTooLong: the key is longer than MaxKeyLen bytes.
	ErrKeyTooLong = newError("key_too_long", fmt.Sprintf("idempotency key longer than %d bytes", MaxKeyLen), true)
	// ErrKeyInvalid: the key is not valid UTF-8 or holds a NUL byte (Postgres text
	// cannot store either).
	ErrKeyInvalid = newError("key_invalid", "idempotency key is not valid UTF-8 text without NUL bytes", true)
	// ErrTenantInvalid: the tenant is too long, not UTF-8, or holds a NUL byte.
	ErrTenantInvalid = newError("tenant_invalid", fmt.Sprintf("tenant must be UTF-8 text without NUL bytes, at most %d bytes", MaxKeyLen), true)
	// ErrConsumerInvalid: the consumer name is empty, too long, not UTF-8, or holds a NUL.
	ErrConsumerInvalid = newError("consumer_invalid", fmt.Sprintf("consumer name must be non-empty UTF-8 text without NUL bytes, at most %d bytes", MaxKeyLen), true)
	// ErrNotJSON: the payload is not JSON, and the fingerprint is canonical JSON.
	ErrNotJSON = newError("payload_not_json", "payload is not valid JSON (the consumer fingerprints canonical JSON)", true)
	// ErrFingerprintMismatch: the key was seen before with a different payload
	// fingerprint. It is never handled as a duplicate and never run again.
	ErrFingerprintMismatch = newError("fingerprint_mismatch", "idempotency key reused with a different payload", true)
	// ErrNotFound: no inbox row has that consumer, tenant and key.
	ErrNotFound = newError("not_found", "no inbox record for that key", false)
	// ErrLeaseHeld: in lease mode, another delivery holds a fresh lease on the key.
	// It is transient: try again after the lease.
	ErrLeaseHeld = newError("lease_held", "another delivery holds the lease on this key", false)
	// ErrLeaseLost: in lease mode, the lease ran out and another delivery took the key
	// over (its fence is newer). It is transient: the newer holder finishes the work.
	ErrLeaseLost = newError("lease_lost", "lease lost to a newer holder (fence changed)", false)
	// ErrInvalidSchema: the schema name is not a plain lower-case identifier.
	ErrInvalidSchema = newError("invalid_schema", "schema must match ^[a-z_][a-z0-9_]{0,62}$", true)
	// ErrSchemaMissing: the idem tables do not exist in the schema. Run the migrations.
	// It is not permanent: the message is nacked, and works once the schema exists.
	ErrSchemaMissing = newError("schema_missing", "idem tables not found: run `idem migrate up` (or inbox.Migrator.Up) first", false)
)

// Code returns the stable code of the first error in err's chain that has one, or ""
// when none does.
func Code(err error) string {
	var c interface{ Code() string }
	if errors.As(err, &c) {
		return c.Code()
	}
	return ""
}

// IsPermanent reports whether an error in err's chain says it is permanent.
func IsPermanent(err error) bool {
	var p interface{ Permanent() bool }
	return errors.As(err, &p) && p.Permanent()
}
