// Package e2e holds the end-to-end SIGKILL suite (e2e_test.go): payments published
// to a real broker protocol (Kafka through kfake, NATS JetStream through an embedded
// nats-server), consumed by three consumer processes that share one consumer group
// or durable, emailed by two dispatcher processes to an SMTP receiver, while a
// killer SIGKILLs a random worker about every half second and Postgres backends are
// cut. The same run through Watermill's in-memory Deduplicator is the peer.
//
// The package has no non-test code; see internal/payments for the scenario.
package e2e
