package inbox

import (
	"fmt"

	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/text"
)

// MaxKeyLen is the longest key, tenant or consumer name the inbox accepts, in bytes.
// It keeps primary-key entries well inside a B-tree page.
const MaxKeyLen = 512

// ValidateKey checks an idempotency key. Each failure is a permanent error: an empty
// key (ErrEmptyKey), one over MaxKeyLen bytes (ErrKeyTooLong), or one that is not
// UTF-8 or holds a NUL byte (ErrKeyInvalid). A key is never guessed or truncated.
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

// DefaultSchema is the Postgres schema idem uses unless told otherwise.
const DefaultSchema = pgschema.Default

// ValidateSchema checks a schema name: a plain lower-case identifier,
// ^[a-z_][a-z0-9_]{0,62}$, or ErrInvalidSchema. idem quotes it in SQL as well, but a
// plain identifier keeps the name the same in psql, in logs and in a user's own
// tools.
func ValidateSchema(schema string) error { return pgschema.Validate(schema) }
