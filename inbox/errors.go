package inbox

import (
	"github.com/idemkit/idem/internal/canonjson"
	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/pgschema"
)

// Error is an idem error with a stable code. Logs and metrics use the code; callers
// compare with errors.Is against the sentinels below. It is the one coded error
// type of every idem package.
type Error = errcode.Error

// Sentinel errors. Each is permanent unless it says otherwise. They are the values
// every idem package returns, so errors.Is holds whichever package produced the
// error.
var (
	// ErrEmptyKey is returned when the message gave no key.
	ErrEmptyKey = inboxdb.ErrEmptyKey
	// ErrKeyTooLong is returned when the key is longer than MaxKeyLen bytes.
	ErrKeyTooLong = inboxdb.ErrKeyTooLong
	// ErrKeyInvalid is returned when the key is not valid UTF-8 or holds a NUL byte
	// (Postgres text cannot store either).
	ErrKeyInvalid = inboxdb.ErrKeyInvalid
	// ErrTenantInvalid is returned when the tenant is too long, not UTF-8, or holds a
	// NUL byte.
	ErrTenantInvalid = inboxdb.ErrTenantInvalid
	// ErrConsumerInvalid is returned when the consumer name is empty, too long, not
	// UTF-8, or holds a NUL byte.
	ErrConsumerInvalid = inboxdb.ErrConsumerInvalid
	// ErrNotJSON is returned when the payload is not JSON and the fingerprint is
	// canonical JSON.
	ErrNotJSON = canonjson.ErrNotJSON
	// ErrFingerprintMismatch is returned when the key was seen before with a
	// different payload fingerprint. It is never handled as a duplicate and never
	// run again.
	ErrFingerprintMismatch = inboxdb.ErrFingerprintMismatch
	// ErrNotFound is returned when no inbox row has that consumer, tenant and key.
	// It is not permanent.
	ErrNotFound = inboxdb.ErrNotFound
	// ErrLeaseHeld is returned, in lease mode, when another delivery holds a fresh
	// lease on the key. It is transient: try again after the lease.
	ErrLeaseHeld = inboxdb.ErrLeaseHeld
	// ErrLeaseLost is returned, in lease mode, when the lease ran out and another
	// delivery took the key over (its fence is newer). It is transient: the newer
	// holder finishes the work.
	ErrLeaseLost = inboxdb.ErrLeaseLost
	// ErrInvalidSchema is returned when the schema name is not a plain lower-case
	// identifier, ^[a-z_][a-z0-9_]{0,62}$. idem quotes it in SQL as well, but a
	// plain identifier keeps the name the same in psql, in logs and in a user's own
	// tools.
	ErrInvalidSchema = pgschema.ErrInvalid
	// ErrSchemaMissing is returned when the idem tables (or a column a newer
	// migration adds) do not exist in the schema: run the migrations. It is not
	// permanent: the message is nacked, and works once the schema exists.
	ErrSchemaMissing = pgschema.ErrMissing
)

// Code returns the stable code of the first error in err's chain that has one, or ""
// when none does.
func Code(err error) string { return errcode.Code(err) }

// IsPermanent reports whether an error in err's chain says it is permanent.
func IsPermanent(err error) bool { return errcode.IsPermanent(err) }
