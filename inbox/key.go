package inbox

import (
	"github.com/idemkit/idem/internal/canonjson"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/pgschema"
)

const (
	// DefaultSchema is the Postgres schema idem uses unless told otherwise.
	DefaultSchema = pgschema.Default
	// DefaultRetention is how long inbox rows live unless a consumer says
	// otherwise (7 days).
	DefaultRetention = inboxdb.DefaultRetention
	// MaxKeyLen is the longest key, tenant or consumer name the inbox accepts, in
	// bytes (512). It keeps primary-key entries well inside a B-tree page.
	MaxKeyLen = inboxdb.MaxKeyLen
	// MaxJSONDepth is the deepest nesting of arrays and objects CanonicalJSON
	// accepts (10000, the limit encoding/json has too).
	MaxJSONDepth = canonjson.MaxDepth
)

// ValidateKey checks an idempotency key. Each failure is a permanent error: an empty
// key (ErrEmptyKey), one over MaxKeyLen bytes (ErrKeyTooLong), or one that is not
// UTF-8 or holds a NUL byte (ErrKeyInvalid). A key is never guessed or truncated.
func ValidateKey(key string) error { return inboxdb.ValidateKey(key) }
