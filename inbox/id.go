package inbox

import "github.com/idemkit/idem/internal/inboxdb"

// The rename step's stand-ins, until the call sites follow: the rename commit
// writes the public ID and State in this file.

// ID names one inbox row: what admin.Admin's Forget and InspectInbox take and
// httpidem.KeyFrom returns.
type ID = inboxdb.ID

// State is an inbox row's state (admin.InboxKey.State holds it as text).
type State = inboxdb.State

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
