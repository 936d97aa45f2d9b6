package consumer

import (
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/idemkit/idem/internal/errcode"

	"cmp"
)

// NewUUID returns a new UUIDv7. Version 7 IDs are ordered by time, so inbox inserts
// land at the right edge of the primary-key B-tree instead of random pages. Make one
// per logical operation and reuse it on every retry: a new ID per attempt defeats the
// inbox.
func NewUUID() string { return uuid.Must(uuid.NewV7()).String() }

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
	msg.Metadata.Set(MetadataErrorCode, cmp.Or(errcode.Code(err), "transient"))
	if IsPermanent(err) {
		msg.Metadata.Set(MetadataErrorPermanent, "true")
	} else {
		delete(msg.Metadata, MetadataErrorPermanent)
	}
}
