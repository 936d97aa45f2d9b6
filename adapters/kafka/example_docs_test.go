package kafka_test

import "github.com/idemkit/idem/adapters/kafka"

// docInFlightPerPartition is the guide's snippet (docs/kafka.md) of the two
// fields that let several records of one partition be out at once: compiled
// with the tests, not run.
func docInFlightPerPartition(cfg *kafka.SubscriberConfig) {
	cfg.MaxInFlightPerPartition = 64 // records of one partition unacked at once
	cfg.UnorderedWithoutKey = false  // the default: records without a key keep partition order
}

var _ = docInFlightPerPartition
