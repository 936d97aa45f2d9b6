package kafka_test

import (
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
)

// docInFlightPerPartition is the guide's snippet (docs/kafka.md) of the two
// fields that let several records of one partition be out at once: compiled
// with the tests, not run.
func docInFlightPerPartition(cfg *kafka.SubscriberConfig) {
	cfg.MaxInFlightPerPartition = 64 // records of one partition unacked at once
	cfg.UnorderedWithoutKey = false  // the default: records without a key keep partition order
}

// docRecordsWithoutUUID is the guide's snippet (docs/kafka.md) for a topic that
// other producers write without the UUID header: the consumer's key, and the
// Subscriber's metrics that show a held partition. Compiled, not run.
func docRecordsWithoutUUID(cfg *consumer.Config, sub *kafka.SubscriberConfig, reg prometheus.Registerer) {
	// The record's position as its key ("topic/partition/offset"), or
	// consumer.BusinessKey(…) for a key in the payload.
	cfg.Key = func(msg *message.Message) (string, error) { return kafka.PartitionOffsetKey(msg), nil }
	// idem_kafka_partition_held and idem_kafka_partition_held_offset.
	sub.Registerer = reg
}

var (
	_ = docInFlightPerPartition
	_ = docRecordsWithoutUUID
)
