package effects

import (
	"errors"
	"fmt"
)

// Error is an effects error with a stable code for logs and metrics. Compare with
// errors.Is against the sentinels.
type Error struct {
	code      string
	msg       string
	permanent bool
}

func newError(code, msg string, permanent bool) *Error {
	return &Error{code: code, msg: msg, permanent: permanent}
}

func (e *Error) Error() string { return "idem: " + e.msg }

// Code is the stable machine-readable code.
func (e *Error) Code() string { return e.code }

// Permanent reports whether retrying the same input is pointless.
func (e *Error) Permanent() bool { return e.permanent }

// Sentinel errors of Enqueue. All are permanent: the same input fails the same way.
var (
	// ErrFingerprintMismatch: the (tenant, kind, key) exists with a different payload.
	ErrFingerprintMismatch = newError("effect_fingerprint_mismatch", "effect key reused with a different payload", true)
	// ErrInvalidKind: the kind is empty, too long or has characters outside
	// [A-Za-z0-9_.:/@+-].
	ErrInvalidKind = newError("effect_kind_invalid", fmt.Sprintf("effect kind must match %s", kindPattern), true)
	// ErrUnknownKind: the kind is valid but not in the allowed kinds.
	ErrUnknownKind = newError("effect_kind_unknown", "unknown effect kind", true)
	// ErrInvalidKey: the effect key is empty, longer than MaxKeyLen, not UTF-8, or
	// holds a NUL byte.
	ErrInvalidKey = newError("effect_key_invalid", fmt.Sprintf("effect key must be non-empty UTF-8 text without NUL bytes, at most %d bytes", MaxKeyLen), true)
	// ErrInvalidTenant: the scope's tenant (Source.Tenant) is longer than MaxKeyLen,
	// not UTF-8, or holds a NUL byte.
	ErrInvalidTenant = newError("effect_tenant_invalid", fmt.Sprintf("effect tenant must be UTF-8 text without NUL bytes, at most %d bytes", MaxKeyLen), true)
	// ErrPayloadTooLarge: the payload is over MaxPayloadLen bytes.
	ErrPayloadTooLarge = newError("effect_payload_too_large", fmt.Sprintf("effect payload larger than %d bytes", MaxPayloadLen), true)
	// ErrBufferClosed: Enqueue was given a scope whose Buffer was already written,
	// typically a handler's context kept and used after the handler returned. The
	// effect would be lost, so it is refused.
	ErrBufferClosed = newError("effect_buffer_closed", "effects.Enqueue after the batch's effects were written: enqueue before the handler returns", true)
	// ErrNoTx: Enqueue was called without a transaction.
	ErrNoTx = newError("effect_no_tx", "effects.Enqueue needs the handler's transaction", true)
	// ErrInvalidSchema: the schema name is not a plain lower-case identifier.
	ErrInvalidSchema = newError("invalid_schema", "schema must match ^[a-z_][a-z0-9_]{0,62}$", true)
	// ErrSchemaMissing: the idem tables do not exist in the schema.
	ErrSchemaMissing = newError("schema_missing", "idem tables not found: run `idem migrate up` (or inbox.Migrator.Up) first", false)
)

// Code returns the stable code of the first error in err's chain that has one.
func Code(err error) string {
	var c interface{ Code() string }
	if errors.As(err, &c) {
		return c.Code()
	}
	return ""
}

func errIsUndefinedTable(err error) bool {
	var pgErr interface{ SQLState() string }
	return errors.As(err, &pgErr) && pgErr.SQLState() == "42P01"
}

func errIsUndefinedColumn(err error) bool {
	var pgErr interface{ SQLState() string }
	return errors.As(err, &pgErr) && pgErr.SQLState() == "42703"
}
