package effects

import (
	"fmt"

	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/pgschema"
)

// Error is an idem error with a stable code for logs and metrics. Compare with
// errors.Is against the sentinels. It is the one coded error type of every idem
// package (inbox.Error and consumer.Error are the same type).
type Error = errcode.Error

// Sentinel errors of Enqueue. All are permanent (the same input fails the same
// way) except ErrSchemaMissing.
var (
	// ErrFingerprintMismatch is returned when the (tenant, kind, key) exists with a
	// different payload.
	ErrFingerprintMismatch = errcode.Permanent("effect_fingerprint_mismatch", "effect key reused with a different payload")
	// ErrInvalidKind is returned when the kind is empty, too long or has characters
	// outside [A-Za-z0-9_.:/@+-].
	ErrInvalidKind = errcode.Permanent("effect_kind_invalid", fmt.Sprintf("effect kind must match %s", kindPattern))
	// ErrUnknownKind is returned when the kind is valid but not in the allowed kinds.
	ErrUnknownKind = errcode.Permanent("effect_kind_unknown", "unknown effect kind")
	// ErrInvalidKey is returned when the effect key is empty, longer than
	// MaxKeyLen, not UTF-8, or holds a NUL byte.
	ErrInvalidKey = errcode.Permanent("effect_key_invalid", fmt.Sprintf("effect key must be non-empty UTF-8 text without NUL bytes, at most %d bytes", MaxKeyLen))
	// ErrInvalidTenant is returned when the scope's tenant (Source.Tenant) is longer
	// than MaxKeyLen, not UTF-8, or holds a NUL byte.
	ErrInvalidTenant = errcode.Permanent("effect_tenant_invalid", fmt.Sprintf("effect tenant must be UTF-8 text without NUL bytes, at most %d bytes", MaxKeyLen))
	// ErrPayloadTooLarge is returned when the payload is over MaxPayloadLen bytes.
	ErrPayloadTooLarge = errcode.Permanent("effect_payload_too_large", fmt.Sprintf("effect payload larger than %d bytes", MaxPayloadLen))
	// ErrBufferClosed is returned when Enqueue is given a scope whose Buffer was
	// already written, typically a handler's context kept and used after the
	// handler returned. The effect would be lost, so it is refused.
	ErrBufferClosed = errcode.Permanent("effect_buffer_closed", "effects.Enqueue after the batch's effects were written: enqueue before the handler returns")
	// ErrNoTx is returned when Enqueue is called without a transaction.
	ErrNoTx = errcode.Permanent("effect_no_tx", "effects.Enqueue needs the handler's transaction")
	// ErrInvalidSchema is returned when the schema name is not a plain lower-case
	// identifier. It is inbox.ErrInvalidSchema.
	ErrInvalidSchema = pgschema.ErrInvalid
	// ErrSchemaMissing is returned when the idem tables (or a column a newer
	// migration adds) do not exist in the schema. It is transient, and it is
	// inbox.ErrSchemaMissing.
	ErrSchemaMissing = pgschema.ErrMissing
	// ErrInvalidConfig is wrapped by the error NewDispatcher (or NewLedgerSender)
	// returns for a config it refuses (code "invalid_config"), unless a more
	// specific sentinel says what is wrong. Every idem package has the same value.
	ErrInvalidConfig = errcode.ErrInvalidConfig
)

// Code returns the stable code of the first error in err's chain that has one.
func Code(err error) string { return errcode.Code(err) }
