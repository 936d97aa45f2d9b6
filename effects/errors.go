package effects

import (
	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/pgschema"
)

// Sentinel errors. Each carries a stable code (inbox.Code reads it) and is
// permanent (the same input fails the same way) unless it says otherwise. They
// are the values every idem package returns, so errors.Is holds whichever package
// produced the error.
var (
	// ErrDispatcherRunning is returned by Run when the Dispatcher is already
	// running. It is transient.
	ErrDispatcherRunning = errcode.Transient("dispatcher_running", "dispatcher is already running")
	// ErrFingerprintMismatch is returned when the (tenant, kind, key) exists with a
	// different payload.
	ErrFingerprintMismatch = effectsdb.ErrFingerprintMismatch
	// ErrInvalidKind is returned when the kind is empty, longer than 255 bytes, or
	// has characters other than letters, digits and _.:/@+- (a letter or digit
	// first).
	ErrInvalidKind = effectsdb.ErrInvalidKind
	// ErrUnknownKind is returned when the scope lists the allowed kinds (a
	// consumer's or httpidem's EffectKinds) and the kind is not one of them.
	ErrUnknownKind = effectsdb.ErrUnknownKind
	// ErrInvalidKey is returned when the key is empty, longer than MaxKeyLen, not
	// UTF-8, or holds a NUL byte.
	ErrInvalidKey = effectsdb.ErrInvalidKey
	// ErrInvalidTenant is returned when the scope's tenant is longer than
	// MaxKeyLen, not UTF-8, or holds a NUL byte.
	ErrInvalidTenant = effectsdb.ErrInvalidTenant
	// ErrPayloadTooLarge is returned when the payload is over MaxPayloadLen bytes.
	ErrPayloadTooLarge = effectsdb.ErrPayloadTooLarge
	// ErrBufferClosed is returned when Enqueue is called in a group-commit batch's
	// handler context after the batch's effects were written, typically a
	// handler's context kept and used after the handler returned. The effect would
	// be lost, so it is refused.
	ErrBufferClosed = effectsdb.ErrBufferClosed
	// ErrNoTx is returned when Enqueue is called without a transaction.
	ErrNoTx = effectsdb.ErrNoTx
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
