package inbox

import (
	"fmt"

	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/pgschema"
)

// Error is an idem error with a stable code. Logs and metrics use the code; callers
// compare with errors.Is against the sentinels below. It is the one coded error
// type of every idem package (effects.Error and consumer.Error are the same type).
type Error = errcode.Error

// Sentinel errors. Each is permanent unless it says otherwise.
var (
	// ErrEmptyKey is returned when the message gave no key.
	ErrEmptyKey = errcode.Permanent("empty_key", "empty idempotency key")
	// ErrKeyTooLong is returned when the key is longer than MaxKeyLen bytes.
	ErrKeyTooLong = errcode.Permanent("key_too_long", fmt.Sprintf("idempotency key longer than %d bytes", MaxKeyLen))
	// ErrKeyInvalid is returned when the key is not valid UTF-8 or holds a NUL byte
	// (Postgres text cannot store either).
	ErrKeyInvalid = errcode.Permanent("key_invalid", "idempotency key is not valid UTF-8 text without NUL bytes")
	// ErrTenantInvalid is returned when the tenant is too long, not UTF-8, or holds a
	// NUL byte.
	ErrTenantInvalid = errcode.Permanent("tenant_invalid", fmt.Sprintf("tenant must be UTF-8 text without NUL bytes, at most %d bytes", MaxKeyLen))
	// ErrConsumerInvalid is returned when the consumer name is empty, too long, not
	// UTF-8, or holds a NUL byte.
	ErrConsumerInvalid = errcode.Permanent("consumer_invalid", fmt.Sprintf("consumer name must be non-empty UTF-8 text without NUL bytes, at most %d bytes", MaxKeyLen))
	// ErrNotJSON is returned when the payload is not JSON and the fingerprint is
	// canonical JSON.
	ErrNotJSON = errcode.Permanent("payload_not_json", "payload is not valid JSON (the consumer fingerprints canonical JSON)")
	// ErrFingerprintMismatch is returned when the key was seen before with a
	// different payload fingerprint. It is never handled as a duplicate and never
	// run again.
	ErrFingerprintMismatch = errcode.Permanent("fingerprint_mismatch", "idempotency key reused with a different payload")
	// ErrNotFound is returned when no inbox row has that consumer, tenant and key.
	// It is not permanent.
	ErrNotFound = errcode.Transient("not_found", "no inbox record for that key")
	// ErrLeaseHeld is returned, in lease mode, when another delivery holds a fresh
	// lease on the key. It is transient: try again after the lease.
	ErrLeaseHeld = errcode.Transient("lease_held", "another delivery holds the lease on this key")
	// ErrLeaseLost is returned, in lease mode, when the lease ran out and another
	// delivery took the key over (its fence is newer). It is transient: the newer
	// holder finishes the work.
	ErrLeaseLost = errcode.Transient("lease_lost", "lease lost to a newer holder (fence changed)")
	// ErrInvalidSchema is returned when the schema name is not a plain lower-case
	// identifier. Every idem package returns this same value.
	ErrInvalidSchema = pgschema.ErrInvalid
	// ErrSchemaMissing is returned when the idem tables (or a column a newer
	// migration adds) do not exist in the schema: run the migrations. It is not
	// permanent: the message is nacked, and works once the schema exists. Every idem
	// package returns this same value.
	ErrSchemaMissing = pgschema.ErrMissing
)

// Code returns the stable code of the first error in err's chain that has one, or ""
// when none does.
func Code(err error) string { return errcode.Code(err) }

// IsPermanent reports whether an error in err's chain says it is permanent.
func IsPermanent(err error) bool { return errcode.IsPermanent(err) }
