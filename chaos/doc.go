// Package chaos is fault injection for testing your own idem consumers: it makes a
// broker misbehave the way at-least-once brokers do, kills your process at the
// places where a crash hurts, and audits the database afterwards.
//
// # What it guarantees
//
//   - [Subscriber] wraps any Watermill message.Subscriber. It duplicates messages,
//     redelivers messages after they were acked, reorders them within a window and
//     delays them. Every delivery is its own *message.Message with the same UUID and
//     its own copy of the payload and metadata. Only the original delivery's ack or
//     nack reaches the upstream message, exactly once; an upstream message is acked
//     only when its original delivery was acked. Injected copies are the
//     Subscriber's own: their acks go nowhere, and a nacked copy is delivered again.
//   - The faults are chosen from Config.Seed and the message's position in the
//     upstream order, so a seed replays the same faults on the same messages.
//   - Close stops every goroutine the Subscriber started.
//   - [Crash] at a [CrashPoint] armed by [EnvCrash] kills the process with SIGKILL
//     there: no deferred call runs, nothing is flushed, as with kill -9 or the OOM
//     killer. Unarmed, it returns at once.
//   - [Auditor] reads the idem inbox and effects tables and a business count you
//     supply, and tells what committed once, twice, or never. A report's reads of
//     its database are one snapshot (one REPEATABLE READ, READ ONLY transaction),
//     and a report whose parts disagree (a business commit without its completed
//     inbox row, an effect row without its commit) is not OK, so
//     [Auditor.Settled] never accepts it.
//
// # What it does not do
//
//   - It does not make the run's timing deterministic: with several messages in
//     flight, when each reaches the handler depends on the scheduler. A seed fixes
//     which faults happen to which messages, not the interleaving.
//   - A Subscriber cannot reorder messages that its upstream hands out one at a
//     time, waiting for each ack (the reorder window then releases each message
//     after Config.ReorderIdle). Copies and redeliveries still arrive out of order.
//   - Redeliveries of acked messages come from the Subscriber's memory; they stop
//     when it is closed. A real broker's redeliveries after a crash are tested by
//     killing the process that holds the broker connection (see docs/testing.md).
//   - It imports nothing public of idem: it works around any consumer, which is
//     how it can compare idem with a peer in the same run. It does not read idem's
//     metrics; pass the counts you have to [AuditQuery].
//
// # Crash points
//
//	BeforeCommit          last statement of your handler: the work is in the
//	                      consumer's transaction, nothing is committed.
//	AfterCommitBeforeAck  CrashMiddleware, outside the idem middleware: the inbox
//	                      row, business writes and effects are committed; the
//	                      message is not acked.
//	MidSend               in your Sender, after the provider accepted the send and
//	                      before returning: the effect is sent and not marked done.
//
// Arm them in the environment of the process under test, for example
// IDEM_CHAOS_CRASH=after-commit-before-ack:0.05,before-commit:nth=3.
package chaos
