// Package effects stores side effects as uniquely keyed rows in the handler's
// transaction, and carries them out afterwards with Senders run by a Dispatcher.
//
// # What it guarantees
//
//   - An effect is durable before it runs. Enqueue writes it in the same
//     transaction as the business write, so it commits with it or not at all.
//   - Every attempt carries the same identity. Delivery.Tenant, Delivery.Kind and
//     Delivery.Key are the same on each attempt, so a receiver that honours
//     idempotency keys (an Idempotency-Key header, a Message-ID, a unique column)
//     applies it once.
//   - Tenants are apart. An effect's identity is (tenant, kind, key): an effect
//     enqueued by a tenant-scoped consumer belongs to the message's tenant ("" when
//     unscoped), so two tenants' "receipt:123" are two effects.
//   - No effect is lost. Each one ends done or dead, never silently gone. A dead
//     effect keeps its last_error (and its error's code, masked text and failure
//     group, for the operator API) and comes back when an operator requeues it
//     (admin, `idem effects requeue`); an operator may instead discard it (state discarded: never sent, deleted after the
//     retention).
//   - One attempt at a time. A claim holds an effect for a lease; a Send's context
//     ends before the lease does, and a claim that waited too long in the queue is
//     handed back unsent. Every state change after a claim checks the claim's fence,
//     so an attempt whose lease ran out cannot overwrite a newer one.
//   - Outcomes are recorded once. An outcome write whose COMMIT reply is lost is
//     retried, and the retry changes nothing that the first write changed; one
//     outcome that the database refuses for its data costs no other outcome its
//     record (the batch is then written row by row). Error text is stored as valid
//     text whatever bytes the error held.
//   - Unknown outcomes are settled, not guessed. When an attempt's outcome is
//     unknown (its process died mid-send, or Send returned an Indefinite error), a
//     Sender that is also a Reconciler is asked whether the effect took place before
//     anything is sent again. What Reconcile cannot settle is counted in
//     idem_effects_unknown_total.
//
// # What it does not guarantee
//
//   - Exactly-once delivery. An effect may run more than once: a crash after the
//     send and before its outcome is recorded is always possible. Exactly-once
//     *effect* needs the receiver's help (the key) or a Reconciler.
//   - Order. Effects are claimed roughly by due time, many at once, by many
//     dispatchers; retries come back later. Do not rely on one effect running
//     before another.
//   - A Sender that ignores its context. Such a sender can outlive its lease, and
//     then run at the same moment as another dispatcher's retry.
//   - That a receiver shared by tenants tells their effects apart. A Sender must pass
//     Delivery.Tenant on with the key; the built-in ones do.
//
// # Running effects
//
// A Dispatcher claims due effects of the kinds it has Senders for, in batches, with
// one UPDATE … FOR UPDATE SKIP LOCKED statement that commits before any send; any
// number of dispatchers in any number of processes share the work. It wakes on
// LISTEN/NOTIFY when effects are enqueued, and polls as a fallback. A transient
// error is retried with exponential backoff and jitter; Permanent errors and
// exhausted attempts make the effect dead. Run(ctx) shuts down gracefully: sends in
// flight finish (up to ShutdownTimeout) and claims not yet started are handed back
// at once.
//
// # Enqueueing
//
// There is one function for one effect, Enqueue, and one for many, EnqueueMany,
// which writes them with one statement, each with the answer Enqueue would give
// it. Both take the scope from ctx. In a consumer or httpidem handler the
// middleware has put it there: the schema, the message or request the effects come
// from (its tenant is theirs), and the kinds allowed. In a consumer's group-commit
// batch an effect is checked at once and written with the rest of the batch in one
// statement (Result.Deferred), and a mismatch found then fails the message that
// enqueued it. Elsewhere, give the schema and tenant with WithScope:
//
//	ctx = effects.WithScope(ctx, effects.Scope{Schema: "idem", Tenant: "acme"})
//	_, err := effects.Enqueue(ctx, tx, effects.Effect{Kind: "email", Key: "receipt:1"})
//
// Effect.Delay holds an effect back: it is due Delay after the Enqueue call (the
// database's clock_timestamp() at the INSERT), not after the start of the
// transaction, and never before the transaction commits.
//
// Built-in senders: PublishSender forwards stored Watermill messages with their
// UUID and metadata, and the tenant in TenantMetadataKey (kinds "publish:<topic>");
// LedgerSender writes one uniquely keyed row per effect into a user table, keyed by
// (tenant, key) with LedgerConfig.TenantColumn.
//
// Tracing (OpenTelemetry, off unless the application installs a provider): an
// effect row keeps the W3C trace context of the span its Enqueue ran under, and
// each send has a span of its own trace that links to it; PublishSender writes the
// send's trace context into the message it publishes. A trace context is never part
// of an effect's identity or fingerprint.
//
// NewDispatcher checks the schema once, at start: it reads Postgres's catalog and
// refuses a schema (on any shard of a map) that lacks idem's tables or one of the
// migrations this build needs, with an error of code schema_missing that names the
// schema, the missing versions and `idem migrate up`. The check is bounded (10
// seconds), and a database that does not answer within that time fails NewDispatcher
// with code database_unavailable (a shard of a map is only logged: the others are
// served). Config.SkipSchemaCheck turns it off, for a role that may not read the
// catalog; a schema that lacks a migration is then found by Run's first claim, which
// logs it and tries again.
package effects
