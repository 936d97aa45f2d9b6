package inbox

import "github.com/idemkit/idem/internal/inboxdb"

// ID names one inbox row: what admin.Admin's Forget and InspectInbox take and
// httpidem.KeyFrom returns.
type ID struct {
	Consumer string
	Tenant   string // "" means no tenant scope
	Key      string
}

// Validate checks the consumer, tenant and key: ErrConsumerInvalid,
// ErrTenantInvalid, or what ValidateKey returns.
func (id ID) Validate() error { return inboxdb.ID(id).Validate() }

// State is an inbox row's state (admin.InboxKey.State holds it as text).
type State string

const (
	// StateCompleted is a key whose handler's work committed.
	StateCompleted State = State(inboxdb.StateCompleted)
	// StateFailed is a key whose handler failed permanently; redeliveries replay
	// the failure.
	StateFailed State = State(inboxdb.StateFailed)
	// StateProcessing is a key a delivery holds until its lease ends (lease mode
	// only).
	StateProcessing State = State(inboxdb.StateProcessing)
)
