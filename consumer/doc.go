// Package consumer is idem's Watermill middleware: it runs every message through the
// Postgres inbox inside the same transaction as the handler's business writes.
//
// What it guarantees, for a consumer C and key K, while the inbox row lives:
//
//   - Once per key. The handler's database work commits at most once, with
//     redelivery, producer duplicates, reordering, concurrent delivery of one key to
//     two instances, and a crash at any point. It commits at least once unless the
//     message is judged a permanent failure.
//   - Effects are durable before they run. effects.Enqueue in the handler, and every
//     message the handler returns, become effect rows in the same transaction.
//   - Same key, different payload, is loud: ErrFingerprintMismatch, never a duplicate.
//   - Transient failures are never frozen: only success and permanent failures are
//     recorded. Any other error rolls back and nacks.
//
// What it does not do: it does not make a handler's calls to the outside world
// happen once (enqueue them as effects instead), and it does not recognise a
// duplicate that arrives after its key's row expired: a key past its expires_at is
// forgotten, whether or not the janitor has deleted the row yet. Lease mode, for
// handlers that must call out themselves, trades the first guarantee for "the
// handler may run again after a lease runs out; its database work still commits
// once".
//
// The handler reads its transaction with Tx(ctx), which panics with ErrNoTx
// outside idem's middleware (TxSafely returns it). In GroupCommit mode that
// transaction is shared with the other messages of a batch, so handler code must
// not assume it owns the whole transaction. A batch is set-based: one statement
// claims all of its keys (in sorted order, so batches cannot deadlock each other),
// one writes every effect and output message of the batch, and a failing message is
// isolated by running the batch again without it, or, when the failure cannot be
// pinned on one message, each message in its own savepoint (at most 32 in one
// transaction).
//
// Config.Batch bounds the batches of GroupCommit mode and of HandleBatch; Lease
// mode has none and refuses a Batch, as the other modes refuse a Lease: a knob
// that does nothing in the chosen Mode is an error of Validate, never ignored.
//
// HandleBatch takes a BatchHandler, which gets the claimed messages of a batch and
// the transaction together, for set-based business writes. Duplicates, recorded
// failures and mismatches never reach it. It names its failing messages with
// ForMessage, and each is answered alone; an error that names none of them is
// isolated by bisection.
//
// The guarantees assume the handler leaves the transaction open. idem cannot stop a
// handler from ending it with raw SQL (Exec "COMMIT" or "ROLLBACK"), but it checks,
// after the handler and before every commit, that the transaction is still open
// and still the one it began. What ran after the handler's own COMMIT or ROLLBACK
// committed on its own, so such a key is recorded as failed (ErrTxEnded, code
// handler_ended_transaction) in a fresh transaction and never run again. A
// set-based batch has claimed every key before its first handler runs, so there a
// commit guard (migration 004) makes a COMMIT that idem did not send fail: the
// batch rolls back whole, and its other messages run again.
//
// idem's middleware must be the innermost: Watermill's Retry, PoisonQueue,
// IgnoreErrors or Duplicator inside it would commit a failed attempt's writes, so
// idem refuses every message with ErrMiddlewareOrder (nacked, nothing run) when one
// of them is the handler it wraps, and rolls back a handler whose message a
// PoisonQueue hidden behind other middlewares poisoned.
//
// A Consumer over a shard map (Config.Shards) routes each message by its tenant
// to its shard, where it runs as on one database; a message without a tenant is
// refused (ErrTenantMissing), unless Config.DefaultTenant names its tenant.
//
// The messages a handler returns are stored as copies with derived IDs; the
// handler's messages, including a forwarded input, are never changed.
//
// Tracing (OpenTelemetry) is off unless the application installs a provider
// (Config.TracerProvider, or the global one): then each message has a span, child
// of the trace context it came with, with claim, handler and commit spans under it
// and its outcome; a batch has a span of its own, linked to its messages' spans.
// The handler's context carries its span, so the effects it enqueues keep its
// trace context. Tracing never changes what is committed, acked or nacked.
//
// New checks the schema once, at start: it reads Postgres's catalog and refuses a
// schema (on any shard of a map) that lacks idem's tables or one of the migrations
// this build needs, with an error of code schema_missing that names the schema, the
// missing versions and `idem migrate up`. The check is bounded (10 seconds), and a
// database that does not answer within that time fails New with code
// database_unavailable (a shard of a map is only logged: the others are served).
// Config.SkipSchemaCheck turns it off, for a role that may not read the catalog; a
// schema that lacks a migration is then found by the first message, and nacked.
package consumer
