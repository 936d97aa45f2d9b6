package inbox

import (
	"context"
	"io/fs"

	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/txmark"
	"github.com/idemkit/idem/janitor"
	"github.com/idemkit/idem/migrate"
)

// The names below moved out of inbox: the schema and its migrator to package
// migrate, the janitor to package janitor, and what only idem's own packages use
// to internal packages. They stay here, deprecated, so that code written against
// earlier versions keeps compiling; they go at the next major version.

// Migration is one numbered step of the schema.
//
// Deprecated: use migrate.Migration.
type Migration = migrate.Migration

// Beginner starts a transaction; *pgxpool.Pool, *pgx.Conn and pgx.Tx all do.
//
// Deprecated: use migrate.Beginner.
type Beginner = migrate.Beginner

// Migrator applies the embedded migrations to one schema.
//
// Deprecated: use migrate.Migrator.
type Migrator = migrate.Migrator

// MigrationStatus is one known migration and whether the database has it.
//
// Deprecated: use migrate.MigrationStatus.
type MigrationStatus = migrate.MigrationStatus

// DownPlan is what reverting one migration does.
//
// Deprecated: use migrate.DownPlan.
type DownPlan = migrate.DownPlan

// ColumnValues is a column a down migration drops, and how many rows hold a value.
//
// Deprecated: use migrate.ColumnValues.
type ColumnValues = migrate.ColumnValues

// TableRows is a table and how many rows it holds.
//
// Deprecated: use migrate.TableRows.
type TableRows = migrate.TableRows

// NewMigrator returns a Migrator for schema (DefaultSchema when empty).
//
// Deprecated: use migrate.New(migrate.Config{Pool: db, Schema: schema}).
func NewMigrator(db Beginner, schema string) (*Migrator, error) {
	return migrate.New(migrate.Config{Pool: db, Schema: schema})
}

// MigrationsFS holds the numbered SQL files (NNN_name.up.sql and NNN_name.down.sql).
//
// Deprecated: use migrate.MigrationsFS.
func MigrationsFS() fs.FS { return migrate.MigrationsFS() }

// GooseMigrationsFS holds the same migrations in goose's form.
//
// Deprecated: use migrate.GooseMigrationsFS.
func GooseMigrationsFS() fs.FS { return migrate.GooseMigrationsFS() }

// Migrations returns the embedded migrations in order.
//
// Deprecated: use migrate.Migrations.
func Migrations() []Migration { return migrate.Migrations() }

// Janitor deletes what the retention lets go, in the inbox and the effects.
//
// Deprecated: use janitor.Janitor.
type Janitor = janitor.Janitor

// JanitorConfig configures a Janitor.
//
// Deprecated: use janitor.Config.
type JanitorConfig = janitor.Config

// Stats is what one janitor pass did.
//
// Deprecated: use janitor.Stats.
type Stats = janitor.Stats

// NewJanitor validates cfg and returns a Janitor.
//
// Deprecated: use janitor.New.
func NewJanitor(cfg JanitorConfig) (*Janitor, error) { return janitor.New(cfg) }

// ErrJanitorBusy is returned when another janitor is running a pass on the schema.
//
// Deprecated: use janitor.ErrBusy (the same value).
var ErrJanitorBusy = janitor.ErrBusy

// Janitor defaults.
const (
	// Deprecated: use janitor.DefaultBatchSize.
	DefaultJanitorBatchSize = janitor.DefaultBatchSize
	// Deprecated: use janitor.DefaultPause.
	DefaultJanitorPause = janitor.DefaultPause
	// Deprecated: use janitor.DefaultInterval.
	DefaultJanitorInterval = janitor.DefaultInterval
	// Deprecated: use janitor.DefaultEffectsRetention.
	DefaultEffectsRetention = janitor.DefaultEffectsRetention
)

// TxMark marks the transaction it runs in as the one idem began.
//
// Deprecated: internal to idem's consumer and httpidem; nothing replaces it.
const TxMark = txmark.Mark

// ErrTxReplaced is returned when the transaction idem began had ended and another
// was open in its place.
//
// Deprecated: internal to idem's consumer and httpidem; nothing replaces it.
var ErrTxReplaced = txmark.ErrTxReplaced

// ErrCommitUnknown is returned when a COMMIT idem sent failed, so whether it
// happened is unknown.
//
// Deprecated: internal to httpidem; consumer.ErrCommitUnknown is the consumer's.
var ErrCommitUnknown = txmark.ErrCommitUnknown

// CommitMarked commits conn's transaction in one round trip, if it carries TxMark.
//
// Deprecated: internal to idem's consumer and httpidem; nothing replaces it.
func CommitMarked(ctx context.Context, conn BatchSender) error { return txmark.Commit(ctx, conn) }

// RollbackMarked rolls back conn's open transaction and reports whether it carried
// TxMark.
//
// Deprecated: internal to idem's consumer and httpidem; nothing replaces it.
func RollbackMarked(ctx context.Context, conn BatchSender) (bool, error) {
	return txmark.Rollback(ctx, conn)
}

// EncodeHeader writes h as the response_headers column stores it.
//
// Deprecated: internal to httpidem; nothing replaces it.
func EncodeHeader(h map[string][]string) []byte { return inboxdb.EncodeHeader(h) }

// DecodeHeader reads what EncodeHeader wrote.
//
// Deprecated: internal to httpidem; nothing replaces it.
func DecodeHeader(b []byte) map[string][]string { return inboxdb.DecodeHeader(b) }
