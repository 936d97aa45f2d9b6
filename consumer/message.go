package consumer

import (
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"cmp"
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

// MetadataErrorCode is the metadata key under which the middleware leaves, on a
// message it returns an error for (so one the router nacks, or a PoisonQueue
// poisons), the error's stable code: Code(err), or "transient" for an error
// without one. A broker adapter sees only the nack; idem's Kafka adapter reads this
// key to log the code with its redelivery pause (a test checks the adapter reads
// this very key).
const MetadataErrorCode = "idem_error_code"

// MetadataErrorPermanent is the metadata key under which the middleware leaves
// "true", next to MetadataErrorCode, when the error it returns is permanent
// (IsPermanent): retrying the message cannot succeed, so nacked it holds its
// partition (Kafka) until a PoisonQueue takes it. The Kafka adapter reads it to
// report the partition as held.
const MetadataErrorPermanent = "idem_error_permanent"

// markErrorCode sets MetadataErrorCode, and MetadataErrorPermanent for a
// permanent error, on msg when err is not nil. It runs in the message's handler
// call, before the router sees the error, so whoever reads the metadata after the
// nack sees it.
func markErrorCode(msg *message.Message, err error) {
	if err == nil || msg == nil {
		return
	}
	if msg.Metadata == nil {
		msg.Metadata = message.Metadata{}
	}
	msg.Metadata.Set(MetadataErrorCode, cmp.Or(Code(err), "transient"))
	if IsPermanent(err) {
		msg.Metadata.Set(MetadataErrorPermanent, "true")
	} else {
		delete(msg.Metadata, MetadataErrorPermanent)
	}
}
