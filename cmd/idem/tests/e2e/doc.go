// Package e2e holds the end-to-end SIGKILL suite (e2e_test.go): payments published
// to a real broker protocol (Kafka through kfake, and through the real broker of
// KAFKA_BROKERS when that is set; NATS JetStream through an embedded
// nats-server, and through the server of NATS_URL when that is set), consumed by three consumer processes that share one consumer
// group or durable, emailed by two dispatcher processes to an SMTP receiver, while
// a killer SIGKILLs a random worker about every half second and Postgres backends
// are cut. The same run through Watermill's in-memory Deduplicator is the peer. One
// more run (TestSIGKILLEndToEnd/shards) spreads 12 tenants over three shards (two
// shard clusters of IDEM_SHARD_URLS and a cluster of its own, which it crashes
// halfway through and starts again), every worker serving every shard, and audits
// each shard. Another (TestSIGKILLEndToEnd/citus) runs on the Citus coordinator of
// IDEM_CITUS_URL, idem and the ledger distributed by tenant over both workers, and
// crashes worker 1 halfway through and starts it again.
//
// What it shows for idem, on every target: every payment committed exactly once
// (lost 0, committed twice 0) and every receipt emailed, repeated only after a
// dispatcher died mid-send. N is IDEM_E2E_N (default 300, the CI size).
//
// The package has no non-test code; see cmd/idem/internal/payments for the scenario.
package e2e
