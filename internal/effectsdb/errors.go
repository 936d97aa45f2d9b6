package effectsdb

import (
	"fmt"

	"github.com/idemkit/idem/internal/errcode"
)

// Sentinel errors of Enqueue; package effects re-exports them as the same values. All are permanent (the same input fails the same
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
)
