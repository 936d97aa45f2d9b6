// Package kafkagroup holds a test of the Kafka adapter in a consumer group of
// three member processes behind idem's consumer middleware (group_test.go):
// members join, leave and are SIGKILLed mid-handler under the broker's real
// session timeouts and rebalances, while the test checks that no offset is
// ever committed past a message that was not acked, and that every message
// commits once in a business table.
//
// A variant runs the members with MaxInFlightPerPartition above 1, in group-commit
// and batch-handler mode, so that acks come out of partition order.
//
// It lives here, not in adapters/kafka, so that the adapter keeps importing
// nothing of idem. It runs on kfake always, and on KAFKA_BROKERS when set.
// The package has no non-test code.
package kafkagroup
