package nats

import (
	"net/textproto"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/propagation"

	"github.com/idemkit/idem/internal/tracing"
)

// The names the adapter writes: message metadata keys, a header, and the values
// of MaxDelivered.By.
const (
	// Metadata keys that the Subscriber sets on every message it delivers. They
	// describe this delivery, so they are not part of the message's intent: idem
	// never fingerprints them. Values are decimal numbers, except the names and
	// MetadataTimestamp (RFC 3339, nanoseconds, UTC).

	MetadataStream       = "nats_stream"        // the stream that stores the message
	MetadataConsumer     = "nats_consumer"      // the consumer that delivered it
	MetadataSubject      = "nats_subject"       // the subject it was published on
	MetadataStreamSeq    = "nats_stream_seq"    // its sequence in the stream: stable across redeliveries
	MetadataConsumerSeq  = "nats_consumer_seq"  // this delivery's sequence in the consumer
	MetadataNumDelivered = "nats_num_delivered" // 1 on the first delivery, 2 on the first redelivery, ...
	MetadataTimestamp    = "nats_timestamp"     // when the stream stored it

	// WatermillUUIDHeader is the header in which Watermill's own NATS adapter
	// (watermill-nats, its NATSMarshaler) carries the message UUID. The publisher
	// writes it besides Nats-Msg-Id, and the subscriber reads it when Nats-Msg-Id
	// is missing, so messages keep their UUID between idem and watermill-nats in
	// both directions.
	WatermillUUIDHeader = "_watermill_message_uuid"

	// How a MaxDelivered was found (MaxDelivered.By).

	// MaxDeliveredByNack: the handler nacked the delivery that reached
	// MaxDeliver, in this process.
	MaxDeliveredByNack = "nack"
	// MaxDeliveredByAdvisory: the server raised a MAX_DELIVERIES advisory. The
	// last delivery was never settled: its handler crashed, or the message was
	// lost on the way, and its AckWait ran out.
	MaxDeliveredByAdvisory = "advisory"
)

// deliveryKeys are the keys above; the publisher does not send them on, so a
// forwarded message never carries a stale delivery description.
var deliveryKeys = map[string]bool{
	MetadataStream: true, MetadataConsumer: true, MetadataSubject: true, MetadataStreamSeq: true,
	MetadataConsumerSeq: true, MetadataNumDelivered: true, MetadataTimestamp: true,
}

// publishDirective reports whether a header is an instruction to JetStream
// for the publish that carried it, rather than part of the message: the
// publish expectations (Nats-Expected-Stream, -Last-Sequence,
// -Last-Subject-Sequence, -Last-Subject-Sequence-Subject, -Last-Msg-Id),
// rollups, per-message TTLs, atomic batches, counters and schedules. They
// are dropped on receipt. Kept, they would be sent again when a handler
// forwards the message or a hook dead-letters it, and refused there
// ("expected stream does not match", "wrong last sequence") or, worse,
// obeyed on the wrong stream (a rollup purges the target's subject).
func publishDirective(key string) bool {
	for _, p := range publishDirectivePrefixes {
		if len(key) >= len(p) && strings.EqualFold(key[:len(p)], p) {
			return true
		}
	}
	return publishDirectives[textproto.CanonicalMIMEHeaderKey(key)]
}

var publishDirectivePrefixes = []string{"Nats-Expected-", "Nats-Batch-"}

// publishDirectives are kept in canonical form (as textproto writes them).
var publishDirectives = map[string]bool{
	"Nats-Rollup":             true,
	"Nats-Ttl":                true,
	"Nats-Incr":               true,
	"Nats-Schedule":           true,
	"Nats-Schedule-Target":    true,
	"Nats-Schedule-Source":    true,
	"Nats-Schedule-Ttl":       true,
	"Nats-Schedule-Time-Zone": true,
	"Nats-Schedule-Rollup":    true,
}

// isUUIDHeader reports whether a header carries the message UUID.
func isUUIDHeader(key string) bool {
	return strings.EqualFold(key, jetstream.MsgIDHeader) || key == WatermillUUIDHeader
}

// toNatsMsg turns a Watermill message into a NATS message on subject. The UUID
// travels as Nats-Msg-Id, so the stream's duplicate window drops a second
// publish of the same message, and as WatermillUUIDHeader for watermill-nats;
// metadata travels as headers, key for key.
func toNatsMsg(subject string, msg *message.Message, prop propagation.TextMapPropagator) *natsgo.Msg {
	h := make(natsgo.Header, len(msg.Metadata)+2)
	for k, v := range msg.Metadata {
		if deliveryKeys[k] || isUUIDHeader(k) {
			continue
		}
		h[k] = []string{v}
	}
	tracing.Inject(msg.Context(), msg.Metadata, prop, func(k, v string) { h[k] = []string{v} })
	h[jetstream.MsgIDHeader] = []string{msg.UUID}
	h[WatermillUUIDHeader] = []string{msg.UUID}
	return &natsgo.Msg{Subject: subject, Header: h, Data: msg.Payload}
}

// fromNatsMsg turns a stored or delivered NATS message back into a Watermill
// message. The UUID is Nats-Msg-Id, or else WatermillUUIDHeader. A message
// published with neither gets an empty UUID: the consumer must then take its
// key from elsewhere (a business key, or MetadataStreamSeq), never from a
// guess. Publish directives (see publishDirective) are dropped.
func fromNatsMsg(subject string, h natsgo.Header, data []byte) *message.Message {
	id := h.Get(jetstream.MsgIDHeader)
	if id == "" {
		id = h.Get(WatermillUUIDHeader)
	}
	msg := message.NewMessage(id, data)
	for k, v := range h {
		if len(v) == 0 || isUUIDHeader(k) || deliveryKeys[k] || publishDirective(k) {
			continue
		}
		msg.Metadata[k] = v[0]
	}
	msg.Metadata[MetadataSubject] = subject
	return msg
}

func setDeliveryMetadata(msg *message.Message, md *jetstream.MsgMetadata) {
	msg.Metadata[MetadataStream] = md.Stream
	msg.Metadata[MetadataConsumer] = md.Consumer
	msg.Metadata[MetadataStreamSeq] = strconv.FormatUint(md.Sequence.Stream, 10)
	msg.Metadata[MetadataConsumerSeq] = strconv.FormatUint(md.Sequence.Consumer, 10)
	msg.Metadata[MetadataNumDelivered] = strconv.FormatUint(md.NumDelivered, 10)
	msg.Metadata[MetadataTimestamp] = md.Timestamp.UTC().Format(time.RFC3339Nano)
}
