package nats

import (
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Metadata keys that the Subscriber sets on every message it delivers. They
// describe this delivery, so they are not part of the message's intent: idem
// never fingerprints them. Values are decimal numbers, except the names and
// MetadataTimestamp (RFC 3339, nanoseconds, UTC).
const (
	MetadataStream       = "nats_stream"        // the stream that stores the message
	MetadataConsumer     = "nats_consumer"      // the consumer that delivered it
	MetadataSubject      = "nats_subject"       // the subject it was published on
	MetadataStreamSeq    = "nats_stream_seq"    // its sequence in the stream: stable across redeliveries
	MetadataConsumerSeq  = "nats_consumer_seq"  // this delivery's sequence in the consumer
	MetadataNumDelivered = "nats_num_delivered" // 1 on the first delivery, 2 on the first redelivery, ...
	MetadataTimestamp    = "nats_timestamp"     // when the stream stored it
)

// deliveryKeys are the keys above; the publisher does not send them on, so a
// forwarded message never carries a stale delivery description.
var deliveryKeys = map[string]bool{
	MetadataStream: true, MetadataConsumer: true, MetadataSubject: true, MetadataStreamSeq: true,
	MetadataConsumerSeq: true, MetadataNumDelivered: true, MetadataTimestamp: true,
}

// toNatsMsg turns a Watermill message into a NATS message on subject. The UUID
// travels as Nats-Msg-Id, so the stream's duplicate window drops a second
// publish of the same message; metadata travels as headers, key for key.
func toNatsMsg(subject string, msg *message.Message) *natsgo.Msg {
	h := make(natsgo.Header, len(msg.Metadata)+1)
	for k, v := range msg.Metadata {
		if deliveryKeys[k] {
			continue
		}
		h[k] = []string{v}
	}
	h[jetstream.MsgIDHeader] = []string{msg.UUID}
	return &natsgo.Msg{Subject: subject, Header: h, Data: msg.Payload}
}

// fromNatsMsg turns a stored or delivered NATS message back into a Watermill
// message. A message that was published without Nats-Msg-Id gets an empty UUID:
// the consumer must then take its key from elsewhere (a business key, or
// MetadataStreamSeq), never from a guess.
func fromNatsMsg(subject string, h natsgo.Header, data []byte) *message.Message {
	msg := message.NewMessage(h.Get(jetstream.MsgIDHeader), data)
	for k, v := range h {
		if k == jetstream.MsgIDHeader || len(v) == 0 || deliveryKeys[k] {
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
