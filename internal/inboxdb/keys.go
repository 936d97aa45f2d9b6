package inboxdb

import (
	"fmt"
	"time"

	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/text"
)

const (
	// MaxKeyLen is the longest key, tenant or consumer name the inbox accepts, in
	// bytes. It keeps primary-key entries well inside a B-tree page.
	MaxKeyLen = 512
	// DefaultRetention is how long inbox rows live unless a consumer says otherwise.
	DefaultRetention = 7 * 24 * time.Hour
)

// The inbox's sentinel errors; package inbox re-exports them as the same values, so
// errors.Is holds whichever package a caller names. Each is permanent unless it
// says otherwise.
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
	// ErrFingerprintMismatch is returned when the key was seen before with a
	// different payload fingerprint.
	ErrFingerprintMismatch = errcode.Permanent("fingerprint_mismatch", "idempotency key reused with a different payload")
	// ErrNotFound is returned when no inbox row has that consumer, tenant and key.
	// It is not permanent.
	ErrNotFound = errcode.Transient("not_found", "no inbox record for that key")
	// ErrLeaseHeld is returned, in lease mode, when another delivery holds a fresh
	// lease on the key. It is transient.
	ErrLeaseHeld = errcode.Transient("lease_held", "another delivery holds the lease on this key")
	// ErrLeaseLost is returned, in lease mode, when the lease ran out and another
	// delivery took the key over (its fence is newer). It is transient.
	ErrLeaseLost = errcode.Transient("lease_lost", "lease lost to a newer holder (fence changed)")
)

// ValidateKey checks an idempotency key: ErrEmptyKey, ErrKeyTooLong or
// ErrKeyInvalid. A key is never guessed or truncated.
func ValidateKey(key string) error {
	switch {
	case key == "":
		return ErrEmptyKey
	case len(key) > MaxKeyLen:
		return fmt.Errorf("%w: got %d bytes", ErrKeyTooLong, len(key))
	case !text.Storable(key):
		return ErrKeyInvalid
	}
	return nil
}

// ValidateTenant checks a tenant scope. The empty tenant means "no tenant".
func ValidateTenant(tenant string) error {
	if len(tenant) > MaxKeyLen || !text.Storable(tenant) {
		return ErrTenantInvalid
	}
	return nil
}

// ValidateConsumer checks a consumer name.
func ValidateConsumer(name string) error {
	if name == "" || len(name) > MaxKeyLen || !text.Storable(name) {
		return ErrConsumerInvalid
	}
	return nil
}
