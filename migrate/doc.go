// Package migrate holds idem's schema and applies it: the numbered SQL migrations
// of the inbox and effects tables, embedded, and the Migrator that applies them to
// one schema. The CLI's `idem migrate` and a call from Go both use it, and the
// files can also be handed to a migration tool of your own (MigrationsFS for
// golang-migrate's layout, GooseMigrationsFS for goose's).
//
// What it guarantees: each migration step is applied once, in order, whatever
// number of processes migrate at once (an advisory lock per schema, and a record
// of the applied versions in <schema>.idem_migrations); Up applies every pending
// step in one transaction, so a failed step leaves the schema as it was; a
// database with a gap in its applied versions, or with a version this build does
// not know, is refused. PlanDown and Revert show, then revert, exactly one step,
// with the rows it would drop counted first. List and PlanDown only read.
//
// On a Citus coordinator, Config.Citus makes Up distribute the tables by tenant
// after the migrations, in the same transaction (see docs/citus.md); a schema
// whose inbox is distributed already gets that step on every Up.
//
// What it does not do: it never reverts more than one step at a time, and it does
// not touch the business tables of your application. Schema names are a template:
// the files name no schema (a "/* schema */" comment marks each table), so your own
// tool applies them into the first schema of search_path. Keep one tool per schema:
// on a schema that holds idem's tables but no record of idem's migrations, every
// method refuses with ErrManagedElsewhere (code schema_managed_elsewhere), naming
// the tool whose version table it finds (goose's goose_db_version, golang-migrate's
// schema_migrations), its version, and what to run instead.
//
// migrate imports pgx and idem's internal leaves, nothing public of idem.
package migrate
