package kafka

import (
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel/propagation"

	"github.com/idemkit/idem/internal/tracing"
)

// The names the adapter writes: a record header, message metadata keys, metric
// names and an error code.
const (
	// UUIDHeader is the record header that carries the Watermill message UUID.
	// It is the header Watermill's own Kafka adapter uses, so the two
	// interoperate.
	UUIDHeader = "_watermill_message_uuid"

	// Metadata keys set on every received message. They describe where this
	// delivery came from; they are overwritten on receipt, so a header with the
	// same name sent by a producer does not survive. MetadataDeliveryCount counts
	// the deliveries of the record by one Subscribe call (so, by one process),
	// starting at 1; it survives a revoke and reassignment within that call, up
	// to the record's commit.

	MetadataTopic         = "kafka_topic"
	MetadataPartition     = "kafka_partition"
	MetadataOffset        = "kafka_offset"
	MetadataKey           = "kafka_key"
	MetadataTimestamp     = "kafka_timestamp" // RFC 3339 with nanoseconds, UTC
	MetadataDeliveryCount = "kafka_delivery_count"

	// Metric names of the Subscriber (SubscriberConfig.Registerer).

	// MetricPartitionHeld is a gauge per group, topic and partition: 1 while a
	// record of the partition, nacked with a permanent error (see
	// consumer.MetadataErrorPermanent), holds it, 0 otherwise. Its series exists
	// at 0 from the moment this process is assigned the partition.
	MetricPartitionHeld = "idem_kafka_partition_held"
	// MetricPartitionHeldOffset is a gauge per group, topic, partition and code:
	// the offset of the record that holds the partition (the lowest, when
	// several do), with the code the handler side left in
	// consumer.MetadataErrorCode. Its one series per held partition goes when the
	// record is acked, or when the partition is revoked or the Subscriber closed.
	MetricPartitionHeldOffset = "idem_kafka_partition_held_offset"

	// CodeGroupRefused is the stable code of a GroupRefusedError, for logs and
	// metrics.
	CodeGroupRefused = "kafka_group_refused"
)

// The metadata keys the Subscriber reads on a message after it is nacked, the
// keys under which idem's consumer middleware leaves them (see
// consumer.MetadataErrorCode and consumer.MetadataErrorPermanent); any other
// handler or middleware may set them too. metadataErrorCode holds the stable
// code of the error that made the handler side nack the message, which the
// Subscriber logs with the redelivery pause (without it, the pause is logged
// without a code). metadataErrorPermanent "true" says the error was permanent,
// so the record can never succeed and holds its partition until it is acked (by
// a PoisonQueue, say): the Subscriber then logs, at its first such nack, an
// error line that says what to configure, and shows the partition as held in
// its metrics (SubscriberConfig.Registerer).
const (
	metadataErrorCode      = "idem_error_code"
	metadataErrorPermanent = "idem_error_permanent"
)

// PartitionOffsetKey returns "topic/partition/offset" for a message received
// by a Subscriber, or "" if the metadata is missing. It names one record of
// the log for good, so it can serve as an inbox key for messages from
// producers that set no UUID header. It names the record, not the business
// operation: the same command produced twice gets two keys.
func PartitionOffsetKey(msg *message.Message) string {
	t, p, o := msg.Metadata.Get(MetadataTopic), msg.Metadata.Get(MetadataPartition), msg.Metadata.Get(MetadataOffset)
	if t == "" || p == "" || o == "" {
		return ""
	}
	return t + "/" + p + "/" + o
}

func toRecord(topic string, key []byte, msg *message.Message, prop propagation.TextMapPropagator) kafka.Message {
	headers := make([]kafka.Header, 0, len(msg.Metadata)+1)
	headers = append(headers, kafka.Header{Key: UUIDHeader, Value: []byte(msg.UUID)})
	for k, v := range msg.Metadata {
		if k == UUIDHeader {
			continue
		}
		headers = append(headers, kafka.Header{Key: k, Value: []byte(v)})
	}
	tracing.Inject(msg.Context(), msg.Metadata, prop, func(k, v string) {
		headers = append(headers, kafka.Header{Key: k, Value: []byte(v)})
	})
	return kafka.Message{Topic: topic, Key: key, Value: msg.Payload, Headers: headers}
}

func fromRecord(r kafka.Message, deliveries int) *message.Message {
	var uuid string
	md := make(message.Metadata, len(r.Headers)+6)
	for _, h := range r.Headers {
		if h.Key == UUIDHeader {
			uuid = string(h.Value)
			continue
		}
		md[h.Key] = string(h.Value)
	}
	md[MetadataTopic] = r.Topic
	md[MetadataPartition] = strconv.Itoa(r.Partition)
	md[MetadataOffset] = strconv.FormatInt(r.Offset, 10)
	md[MetadataKey] = string(r.Key)
	md[MetadataTimestamp] = r.Time.UTC().Format(time.RFC3339Nano)
	md[MetadataDeliveryCount] = strconv.Itoa(deliveries)
	msg := message.NewMessage(uuid, r.Value)
	msg.Metadata = md
	return msg
}
