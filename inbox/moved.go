package inbox

import (
	"github.com/idemkit/idem/internal/canonjson"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/pgschema"
)

// The names below moved to internal/inboxdb and internal/canonjson. They stay
// here only until the call sites follow (the rename commit deletes this file).

type (
	Store       = inboxdb.Store
	Claim       = inboxdb.Claim
	ClaimResult = inboxdb.ClaimResult
	Record      = inboxdb.Record
	DBTX        = inboxdb.DBTX
	BatchSender = inboxdb.BatchSender
)

var (
	NewStore         = inboxdb.NewStore
	ValidateConsumer = inboxdb.ValidateConsumer
	ValidateTenant   = inboxdb.ValidateTenant
	ValidateSchema   = pgschema.Validate
	IsCanonical      = canonjson.IsCanonical
)

func Canonicalize(payload []byte, opts JSONOptions) ([]byte, error) {
	return canonjson.Canonicalize(payload, canonjson.Options(opts))
}
