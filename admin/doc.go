// Package admin is idem's operator API: the reads and actions that the idem CLI and
// its web console run, as Go functions anyone can call.
//
//   - Stats: rows per consumer and state, effects per kind and state, and the age of
//     the oldest pending effect.
//   - ListInbox and ListEffects: inbox keys and effects with filters (consumer,
//     tenant, kind, state, key prefix, time range) and keyset paging over the
//     primary key, so a cursor stays valid while rows are inserted and deleted.
//   - InspectInbox, InspectEffect and Find: one inbox key with its stored HTTP
//     response (status, header names and values, body size; never the body unless
//     asked) and the effects it made; one effect; or a key looked up across every
//     consumer and every effect kind.
//   - Requeue and RequeueDead: dead effects back to pending (effectsdb.RequeueDead).
//   - Forget: delete one inbox key, audited in the log.
//   - Failure groups: ListGroups and Group show failed inbox keys and dead effects
//     grouped by consumer or kind, tenant, code and masked error text;
//     RetryGroup, DiscardGroup and ReleaseGroup act on a group's failures up to a
//     snapshot bound, with a dry run and an audit note stored in failure_actions
//     (ListActions). With Config.Registerer, metrics of the failures and repairs.
//   - Activity: per-minute inbox keys completed and failed, effects sent and dead,
//     and the pending backlog with its oldest age, over the last hour or day, each
//     read from a range of a partial index (the console's charts).
//
// An Admin is a front over one part a database: one for Config.Pool, or one a
// shard of Config.Shards. Every read and action runs the same code on its parts
// through internal/fanout, which merges what they return; with one database the
// one part's answer is the Admin's as it is (its page, its cursor, its error).
// Over a shard map lists merge the shards' pages with a cursor carrying each
// shard's position, a failure group is one row of the groups list with its
// shards' parts summed, Stats sums and lists each shard, one key is looked up on
// every shard; an action changes a tenant's rows only on the shard its route
// names, and is refused (ErrOffRoute) when some are elsewhere; a shard that does
// not answer is an error naming it (ErrShardUnavailable), never a silent gap.
// MoveTenant moves a tenant's rows, in every state, to its new shard. See
// merge.go and move.go.
//
// On Citus (a schema migrated with migrate.Config.Citus, found by itself, once,
// as the consumer finds it) the reads and actions run on the coordinator: Find
// and the failure group list use forms of their statements that Citus takes
// (see docs/citus.md), and MoveTenant is refused (ErrCitusMovesTenants).
//
// What it guarantees: every statement is SQL of this package with bind parameters,
// on a validated and quoted schema; reads take no locks that a consumer or a
// dispatcher waits on; times (ages, leases, "stuck") are the database's clock. An
// action changes exactly what it names and says so (a count, or ErrNotFound,
// ErrNotDead, ErrLeaseHeld).
//
// What it does not do: it is not a monitoring API. Stats and the lists scan the
// tables, which is right for an operator's question and wrong for a scrape every
// few seconds (alert on the Prometheus metrics instead). Forget is dangerous by
// design: the next delivery of a forgotten key runs its handler again, so the
// business work may commit a second time. The effects that the first run made keep
// their keys, so a re-run that enqueues the same effects enqueues nothing new.
//
// admin imports inbox, effects, pgx and idem's internal leaves: it is the one place
// that reads both tables together, which idem's design keeps out of inbox and
// effects (they import nothing public of idem) and out of cmd/ (no SQL there).
package admin
