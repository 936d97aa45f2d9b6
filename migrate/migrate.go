package migrate

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"cmp"

	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/shard"
)

// The up and down files are the single source of the schema. The goose files are
// generated from them (cmd/idem/internal/goosegen); a test fails when they are stale.
//go:generate go run ../cmd/idem/internal/goosegen -src migrations -dst migrations/goose

//go:embed migrations/*.sql
var migrationFiles embed.FS

//go:embed migrations/goose/*.sql
var gooseFiles embed.FS

// MigrationsFS holds the numbered SQL files (NNN_name.up.sql and NNN_name.down.sql),
// named as golang-migrate reads them, for a migration tool of your own. Each
// "/* schema */" marker is a comment, so the files apply as they are, into the
// first schema of search_path. Each file applies as one multi-statement query.
func MigrationsFS() fs.FS {
	sub, _ := fs.Sub(migrationFiles, "migrations")
	return sub
}

// GooseMigrationsFS holds the same migrations in goose's form: one NNN_name.sql per
// version, the up file under "-- +goose Up" and the down file under
// "-- +goose Down", with StatementBegin/StatementEnd around the statements that
// hold semicolons of their own (function bodies, DO blocks). Apply them with the
// target schema first in search_path, for example:
//
//	provider, err := goose.NewProvider(goose.DialectPostgres, db, migrate.GooseMigrationsFS())
//
// where db's connections have search_path set to the schema (it must exist).
func GooseMigrationsFS() fs.FS {
	sub, _ := fs.Sub(gooseFiles, "migrations/goose")
	return sub
}

// schemaMarker is replaced by the quoted schema name and a dot.
const schemaMarker = "/* schema */"

// A Migration is one numbered step of the schema.
type Migration struct {
	Version int
	Name    string
	Up      string
	Down    string
}

var migrationName = regexp.MustCompile(`^(\d+)_([a-z0-9_]+)\.(up|down)\.sql$`)

// Migrations returns the embedded migrations in order. It panics if the embedded
// files have a gap or lack a half, which a test catches before any release.
func Migrations() []Migration {
	ms, err := loadMigrations(MigrationsFS())
	if err != nil {
		panic(err)
	}
	return ms
}

func loadMigrations(fsys fs.FS) ([]Migration, error) {
	entries, err := fs.ReadDir(fsys, ".")
	if err != nil {
		return nil, err
	}
	byVersion := map[int]*Migration{}
	for _, e := range entries {
		m := migrationName.FindStringSubmatch(e.Name())
		if m == nil {
			return nil, fmt.Errorf("migration file %q is not named NNN_name.up.sql or NNN_name.down.sql", e.Name())
		}
		v, _ := strconv.Atoi(m[1])
		body, err := fs.ReadFile(fsys, path.Join(".", e.Name()))
		if err != nil {
			return nil, err
		}
		mig := byVersion[v]
		if mig == nil {
			mig = &Migration{Version: v, Name: m[2]}
			byVersion[v] = mig
		}
		if mig.Name != m[2] {
			return nil, fmt.Errorf("migration %d has two names: %q and %q", v, mig.Name, m[2])
		}
		if m[3] == "up" {
			mig.Up = string(body)
		} else {
			mig.Down = string(body)
		}
	}
	out := make([]Migration, 0, len(byVersion))
	for v := 1; v <= len(byVersion); v++ {
		mig, ok := byVersion[v]
		if !ok {
			return nil, fmt.Errorf("migrations have a gap: version %d is missing", v)
		}
		if mig.Up == "" || mig.Down == "" {
			return nil, fmt.Errorf("migration %d lacks its up or down file", v)
		}
		out = append(out, *mig)
	}
	return out, nil
}

// Beginner starts a transaction; *pgxpool.Pool, *pgx.Conn and pgx.Tx all do.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// DefaultSchema is the schema the Migrator migrates unless Config.Schema says
// otherwise.
const DefaultSchema = pgschema.Default

// Config configures a Migrator.
type Config struct {
	// Pool runs the migrations. Required. A *pgxpool.Pool or *pgx.Conn gets a
	// transaction of its own per call; a pgx.Tx gets a savepoint in the caller's
	// transaction.
	Pool Beginner
	// Schema is the schema to migrate (DefaultSchema when empty). Up creates it.
	Schema string
	// Shards, in place of Pool and Schema, migrates every shard of the map (see
	// package shard, and New); Pool and Schema must then be unset.
	Shards *shard.Map
	// Citus: Pool is a Citus coordinator, and Up distributes idem's tables by
	// tenant after the migrations (inbox and effects colocated, failure_actions a
	// reference table), in the same transaction; see docs/citus.md. A schema whose
	// inbox is distributed already is treated so whatever Citus says. Up fails
	// with ErrNoCitus on a database without the citus extension.
	Citus bool
}

// WithDefaults returns c with every unset field at its default.
func (c Config) WithDefaults() Config {
	if c.Shards == nil {
		c.Schema = cmp.Or(c.Schema, DefaultSchema)
	}
	return c
}

// Validate reports what New would refuse in c: no Pool, or a schema name that is
// not a plain lower-case identifier. The empty schema is the default, so a config
// with a Pool passes.
func (c Config) Validate() error {
	c = c.WithDefaults()
	return shard.ValidateDB(c.Shards, c.Pool, c.Schema)
}

// ErrInvalidConfig is wrapped by the error New returns for a config it refuses
// (code "invalid_config"), unless a more specific sentinel says what is wrong
// (inbox.ErrInvalidSchema). Every idem package has the same value.
var ErrInvalidConfig = errcode.ErrInvalidConfig

// Migrator applies the embedded migrations to one schema. It records applied
// versions in <schema>.idem_migrations, refuses a database with a gap or with a
// version it does not know, and holds an advisory lock while it works, so two
// processes migrating at once apply each step once.
type Migrator struct {
	db         Beginner
	schema     string
	migrations []Migration
	// shards, with a shard map, are one Migrator a shard, in map order (db is
	// nil then).
	shards []*Migrator
	names  []string
	// citus: Config.Citus.
	citus bool
}

// New returns a Migrator for cfg.Schema, or an error that wraps "invalid config".
// With cfg.Shards it migrates every shard: Up applies to each in map order; the
// other methods work on one shard (Shard).
func New(cfg Config) (*Migrator, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	if cfg.Shards != nil {
		m := &Migrator{migrations: Migrations(), names: cfg.Shards.Names()}
		for _, s := range cfg.Shards.Shards {
			m.shards = append(m.shards, &Migrator{db: s.Pool, schema: s.SchemaName(), migrations: m.migrations, citus: cfg.Citus})
		}
		return m, nil
	}
	return &Migrator{db: cfg.Pool, schema: cfg.Schema, migrations: Migrations(), citus: cfg.Citus}, nil
}

// ErrOneShard is returned by a method that works on one database when the Migrator
// has a shard map: call it on Shard(name).
var ErrOneShard = errcode.Permanent("one_shard", "this migrator has a shard map; call the method on Shard(name)")

// Shard returns the Migrator of the named shard, or nil if the map has no such
// shard (or the Migrator has no map).
func (m *Migrator) Shard(name string) *Migrator {
	for i, n := range m.names {
		if n == name {
			return m.shards[i]
		}
	}
	return nil
}

// Schema is the schema the Migrator migrates.
func (m *Migrator) Schema() string { return m.schema }

// MigrationStatus is one known migration and whether the database has it.
type MigrationStatus struct {
	Version   int
	Name      string
	Applied   bool
	AppliedAt time.Time
}

// Up applies every pending migration, in order, in one transaction. It returns the
// versions it applied; none when the schema is current, so calling it twice is safe.
// In Citus mode (Config.Citus, or a schema whose inbox is distributed) it then
// distributes the tables not yet distributed, in the same transaction.
// With a shard map it migrates every shard, each in its own transaction, and
// returns the versions applied on any of them; a shard that fails does not stop the
// others, and the error names every shard that failed (run Up again once they are
// back: the shards already current apply nothing).
func (m *Migrator) Up(ctx context.Context) ([]int, error) {
	if m.shards != nil {
		var all []int
		var errs []error
		for i, sm := range m.shards {
			v, err := sm.Up(ctx)
			if err != nil {
				errs = append(errs, fmt.Errorf("shard %q: %w", m.names[i], err))
			}
			for _, x := range v {
				if !slices.Contains(all, x) {
					all = append(all, x)
				}
			}
		}
		slices.Sort(all)
		return all, errors.Join(errs...)
	}
	var applied []int
	err := m.locked(ctx, true, func(tx pgx.Tx, have []int) error {
		for _, mig := range m.migrations[len(have):] {
			if _, err := tx.Exec(ctx, m.render(mig.Up)); err != nil {
				return fmt.Errorf("apply migration %03d_%s: %w", mig.Version, mig.Name, err)
			}
			if _, err := tx.Exec(ctx, `INSERT INTO `+pgschema.Quote(m.schema)+`.idem_migrations (version, name) VALUES ($1, $2)`, mig.Version, mig.Name); err != nil {
				return err
			}
			applied = append(applied, mig.Version)
		}
		return m.distribute(ctx, tx)
	})
	return applied, err
}

// Down reverts the newest applied migration, one step, without asking. It returns
// its version, or 0 when nothing was applied. A schema that does not exist (or has
// no migrations table) has nothing to revert, and Down creates nothing in it.
// PlanDown and Revert are the careful pair: look first, then revert exactly the
// step that was looked at.
func (m *Migrator) Down(ctx context.Context) (int, error) {
	if m.shards != nil {
		return 0, ErrOneShard
	}
	plan, err := m.revert(ctx, 0)
	return plan.Version, err
}

// DownPlan is what reverting one migration does: the step, its SQL, and the
// tables its down file drops that exist now, with their rows.
type DownPlan struct {
	// Version is 0 when no migration is applied: there is nothing to revert.
	Version int
	Name    string
	// SQL is the down migration, rendered for the schema.
	SQL string
	// Tables are the tables it drops that exist, in the order it drops them.
	Tables []TableRows
	// Columns are the columns it drops from tables it keeps (for example the stored
	// HTTP responses of migration 003), with how many rows hold a value in each.
	Columns []ColumnValues
}

// ColumnValues is a column a down migration drops, and how many rows hold a
// non-NULL value in it: the data that goes with it.
type ColumnValues struct {
	Table  string
	Column string
	Rows   int64
}

// TableRows is a table and how many rows it holds.
type TableRows struct {
	Table string
	Rows  int64
}

// PlanDown says what Down would revert now, and what that would drop, counting
// the rows of each table. It only reads (in a READ ONLY transaction) and creates
// nothing, not even a missing schema.
func (m *Migrator) PlanDown(ctx context.Context) (DownPlan, error) {
	if m.shards != nil {
		return DownPlan{}, ErrOneShard
	}
	var plan DownPlan
	err := m.readOnly(ctx, func(tx pgx.Tx, have []int, _ map[int]time.Time) error {
		if len(have) == 0 {
			return nil
		}
		var err error
		plan, err = m.plan(ctx, tx, m.migrations[len(have)-1], false)
		return err
	})
	return plan, err
}

// Revert reverts migration version, which must be the newest applied one (the
// Version of a PlanDown), and returns what it dropped, with the rows each table
// held when it was dropped (counted under an exclusive lock, so exactly). If
// the schema's newest migration is another one now, it reverts nothing and says
// so: a plan is never applied to a schema that changed after it was made.
func (m *Migrator) Revert(ctx context.Context, version int) (DownPlan, error) {
	if m.shards != nil {
		return DownPlan{}, ErrOneShard
	}
	if version < 1 {
		return DownPlan{}, fmt.Errorf("revert: version %d: a migration version starts at 1", version)
	}
	return m.revert(ctx, version)
}

// revert reverts the newest migration, which must be version unless version is 0.
func (m *Migrator) revert(ctx context.Context, version int) (DownPlan, error) {
	var plan DownPlan
	err := m.locked(ctx, false, func(tx pgx.Tx, have []int) error {
		newest := len(have)
		if version != 0 && newest != version {
			return fmt.Errorf("schema %s is at migration %d now, not %d: another process migrated it; look again (idem migrate list) before reverting", m.schema, newest, version)
		}
		if newest == 0 {
			return nil
		}
		mig := m.migrations[newest-1]
		var err error
		if plan, err = m.plan(ctx, tx, mig, true); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, plan.SQL); err != nil {
			return fmt.Errorf("revert migration %03d_%s: %w", mig.Version, mig.Name, err)
		}
		if _, err := tx.Exec(ctx, `DELETE FROM `+pgschema.Quote(m.schema)+`.idem_migrations WHERE version = $1`, mig.Version); err != nil {
			return err
		}
		return nil
	})
	if err != nil {
		return DownPlan{}, err
	}
	return plan, nil
}

// plan counts the rows of the tables mig's down file drops, and the values in the
// columns it drops. With lock, it first locks each table as DROP would, so that the
// counts are what is dropped.
func (m *Migrator) plan(ctx context.Context, tx pgx.Tx, mig Migration, lock bool) (DownPlan, error) {
	plan := DownPlan{Version: mig.Version, Name: mig.Name, SQL: m.render(mig.Down)}
	for _, table := range droppedTables(mig.Down) {
		rows, found, err := m.count(ctx, tx, lock, table, "", `SELECT to_regclass($1) IS NOT NULL`, pgschema.Table(m.schema, table))
		if err != nil {
			return plan, err
		}
		if found {
			plan.Tables = append(plan.Tables, TableRows{Table: table, Rows: rows})
		}
	}
	for _, c := range droppedColumns(mig.Down) {
		rows, found, err := m.count(ctx, tx, lock, c.Table, c.Column, `SELECT EXISTS (SELECT 1 FROM information_schema.columns
			WHERE table_schema = $1 AND table_name = $2 AND column_name = $3)`, m.schema, c.Table, c.Column)
		if err != nil {
			return plan, err
		}
		if found {
			c.Rows = rows
			plan.Columns = append(plan.Columns, c)
		}
	}
	return plan, nil
}

// count counts the rows of table, or its rows with a value in column when column is
// set, if exists (a statement that answers one bool, with its args) says the table
// or column is there; found is false otherwise. With lock, it takes the lock DROP
// would take first.
func (m *Migrator) count(ctx context.Context, tx pgx.Tx, lock bool, table, column, exists string, args ...any) (rows int64, found bool, err error) {
	if err := tx.QueryRow(ctx, exists, args...).Scan(&found); err != nil || !found {
		return 0, false, err
	}
	name := pgschema.Table(m.schema, table)
	if lock {
		if _, err := tx.Exec(ctx, `LOCK TABLE `+name+` IN ACCESS EXCLUSIVE MODE`); err != nil {
			return 0, false, err
		}
	}
	sql, what := `SELECT count(*) FROM `+name, "the rows of "+name
	if column != "" {
		col := pgschema.Quote(column)
		sql, what = sql+` WHERE `+col+` IS NOT NULL`, "the values of "+name+"."+col
	}
	if err := tx.QueryRow(ctx, sql).Scan(&rows); err != nil {
		return 0, false, fmt.Errorf("count %s: %w", what, err)
	}
	return rows, true, nil
}

var (
	dropTableStmt  = regexp.MustCompile(`(?is)\bDROP\s+TABLE\s+(?:IF\s+EXISTS\s+)?([^;]+)`)
	alterTableStmt = regexp.MustCompile(`(?is)\bALTER\s+TABLE\s+/\* schema \*/([a-z0-9_]+)([^;]+)`)
	dropColumn     = regexp.MustCompile(`(?is)\bDROP\s+COLUMN\s+(?:IF\s+EXISTS\s+)?([a-z0-9_]+)`)
	markedName     = regexp.MustCompile(`/\* schema \*/([a-z0-9_]+)`)
)

// droppedTables are the tables a down migration's DROP TABLE statements name, in
// order. The files are our own, embedded, and name every table with the schema
// marker, which a test checks.
func droppedTables(downSQL string) []string {
	var out []string
	for _, stmt := range dropTableStmt.FindAllStringSubmatch(downSQL, -1) {
		for _, n := range markedName.FindAllStringSubmatch(stmt[1], -1) {
			out = append(out, n[1])
		}
	}
	return out
}

// droppedColumns are the columns a down migration's ALTER TABLE … DROP COLUMN
// clauses name, in order, with their tables.
func droppedColumns(downSQL string) []ColumnValues {
	var out []ColumnValues
	for _, stmt := range alterTableStmt.FindAllStringSubmatch(downSQL, -1) {
		for _, c := range dropColumn.FindAllStringSubmatch(stmt[2], -1) {
			out = append(out, ColumnValues{Table: stmt[1], Column: c[1]})
		}
	}
	return out
}

// List returns every known migration and whether it is applied. It only reads:
// it runs in a READ ONLY transaction, takes no lock, and creates nothing, so it
// works for a read-only role or on a standby, and a schema that does not exist
// lists every migration as not applied.
func (m *Migrator) List(ctx context.Context) ([]MigrationStatus, error) {
	if m.shards != nil {
		return nil, ErrOneShard
	}
	var out []MigrationStatus
	err := m.readOnly(ctx, func(_ pgx.Tx, _ []int, times map[int]time.Time) error {
		for _, mig := range m.migrations {
			at, ok := times[mig.Version]
			out = append(out, MigrationStatus{Version: mig.Version, Name: mig.Name, Applied: ok, AppliedAt: at})
		}
		return nil
	})
	return out, err
}

// readCommitted runs fn in a transaction at READ COMMITTED, whatever the session's
// default_transaction_isolation says. Under REPEATABLE READ or SERIALIZABLE the
// snapshot is taken by the transaction's first statement, the lock, before it
// waits: a migrator that waited for another would not see the versions that one
// applied, and would apply them again. (A db that can only Begin, such as a pgx.Tx,
// gets a savepoint in the caller's transaction, at the caller's isolation.)
func (m *Migrator) readCommitted(ctx context.Context, fn func(tx pgx.Tx) error) error {
	if b, ok := m.db.(interface {
		BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
	}); ok {
		return pgx.BeginTxFunc(ctx, b, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, fn)
	}
	return pgx.BeginFunc(ctx, m.db, fn)
}

// readOnly runs fn in a READ ONLY transaction with the applied versions.
func (m *Migrator) readOnly(ctx context.Context, fn func(tx pgx.Tx, have []int, times map[int]time.Time) error) error {
	return pgx.BeginFunc(ctx, m.db, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SET TRANSACTION READ ONLY`); err != nil {
			return err
		}
		have, times, err := m.applied(ctx, tx)
		if err != nil {
			return err
		}
		return fn(tx, have, times)
	})
}

// locked runs fn in a transaction that holds the schema's migration lock, with the
// applied versions, after checking they are a gap-free prefix of the known ones.
// With create, it first creates the schema and its migrations table if missing;
// without, a missing one means no version is applied, and nothing is created.
func (m *Migrator) locked(ctx context.Context, create bool, fn func(tx pgx.Tx, have []int) error) error {
	return m.readCommitted(ctx, func(tx pgx.Tx) error {
		// The lock is taken before CREATE SCHEMA: two processes creating one schema
		// at once would otherwise collide on the catalog's unique index.
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtextextended('idem.migrate:' || $1, 0))`, m.schema); err != nil {
			return err
		}
		if create {
			q := pgschema.Quote(m.schema)
			if _, err := tx.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS `+q); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+q+`.idem_migrations (
				version    integer PRIMARY KEY,
				name       text NOT NULL,
				applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
				return err
			}
		}
		have, _, err := m.applied(ctx, tx)
		if err != nil {
			return err
		}
		return fn(tx, have)
	})
}

// applied reads the applied versions and when each was applied: none when the
// schema or its migrations table does not exist. It refuses versions this build
// does not know and gaps.
func (m *Migrator) applied(ctx context.Context, tx pgx.Tx) ([]int, map[int]time.Time, error) {
	table := pgschema.Quote(m.schema) + ".idem_migrations"
	var exists bool
	if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, table).Scan(&exists); err != nil {
		return nil, nil, err
	}
	times := map[int]time.Time{}
	if !exists {
		return nil, times, nil
	}
	rows, err := tx.Query(ctx, `SELECT version, applied_at FROM `+table+` ORDER BY version`)
	if err != nil {
		return nil, nil, err
	}
	var have []int
	for rows.Next() {
		var v int
		var at time.Time
		if err := rows.Scan(&v, &at); err != nil {
			return nil, nil, err
		}
		have = append(have, v)
		times[v] = at
	}
	if err := rows.Err(); err != nil {
		return nil, nil, err
	}
	for i, v := range have {
		if v > len(m.migrations) {
			return nil, nil, fmt.Errorf("schema %s is at migration %d, newer than this build knows (%d): upgrade idem", m.schema, slices.Max(have), len(m.migrations))
		}
		if v != i+1 {
			return nil, nil, fmt.Errorf("schema %s has a gap in its applied migrations: %v; refusing to migrate", m.schema, have)
		}
	}
	return have, times, nil
}

func (m *Migrator) render(sql string) string {
	return strings.ReplaceAll(sql, schemaMarker, pgschema.Quote(m.schema)+".")
}
