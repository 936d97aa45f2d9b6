package consumer

import (
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
)

// NewUUID returns a new UUIDv7. Version 7 IDs are ordered by time, so inbox inserts
// land at the right edge of the primary-key B-tree instead of random pages. Make one
// per logical operation and reuse it on every retry: a new ID per attempt defeats the
// inbox.
func NewUUID() string { return uuid.Must(uuid.NewV7()).String() }

// NewMessage returns a Watermill message with a UUIDv7 (see NewUUID).
func NewMessage(payload []byte) *message.Message {
	return message.NewMessage(NewUUID(), payload)
}
