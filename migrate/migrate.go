package migrate

import (
	"context"
	"embed"
	"fmt"
	"io/fs"
	"path"
	"regexp"
	"slices"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/fanout"
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

// A Migration is one numbered step of the schema. Migrations returns the steps;
// List returns them with where and since when each is applied.
type Migration struct {
	Version int
	Name    string
	Up      string
	Down    string
	// Shard is the shard List read the step's state on ("" for one database).
	Shard string
	// Applied says whether List found the step applied; AppliedAt is when.
	Applied   bool
	AppliedAt time.Time
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

// Config configures a Migrator.
type Config struct {
	// Pool runs the migrations. Required. A *pgxpool.Pool or *pgx.Conn gets a
	// transaction of its own per call; a pgx.Tx gets a savepoint in the caller's
	// transaction.
	Pool interface {
		Begin(ctx context.Context) (pgx.Tx, error)
	}
	// Schema is the schema to migrate ("idem" when empty). Up creates it.
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
	c.Schema = fanout.Schema(c.Shards, c.Schema, pgschema.Default)
	return c
}

// Validate reports what New would refuse in c: no Pool, or a schema name that is
// not a plain lower-case identifier. The empty schema is the default, so a config
// with a Pool passes.
func (c Config) Validate() error {
	c = c.WithDefaults()
	return fanout.ValidateDB(c.Shards, c.Pool, c.Schema)
}

// forShard is the config of shard s's part: c with s's pool and schema in place of
// the map.
func (c Config) forShard(s shard.Shard) Config {
	c.Pool, c.Schema, c.Shards = s.Pool, s.SchemaName(), nil
	return c
}

var (
	// ErrInvalidConfig is wrapped by the error New returns for a config it refuses
	// (code "invalid_config"), unless a more specific sentinel says what is wrong
	// (inbox.ErrInvalidSchema). Every idem package has the same value.
	ErrInvalidConfig = errcode.ErrInvalidConfig

	// ErrManagedElsewhere is returned by Up, List, PlanDown, Down and Revert when
	// the schema holds idem's tables but idem's migrator has no record of them (its
	// <schema>.idem_migrations is missing or empty): another tool applied them. The
	// message names the tool when its version table is found (goose's
	// goose_db_version, golang-migrate's schema_migrations, in the schema or in the
	// first schema of search_path that has one), with its version, and says what to
	// run instead. Nothing is changed: run that tool, keeping one tool per schema.
	ErrManagedElsewhere = errcode.Permanent("schema_managed_elsewhere",
		"another migration tool manages the schema")

	// ErrNoCitus is returned by Up in Citus mode (Config.Citus) on a database without
	// the citus extension: install it (CREATE EXTENSION citus) on the coordinator, or
	// migrate without Citus mode.
	ErrNoCitus = errcode.Permanent("no_citus", "Citus mode needs the citus extension, which this database lacks: run CREATE EXTENSION citus on the coordinator, or migrate without Citus mode")
)

// errShardsDiffer is returned by PlanDown and Revert over a shard map whose shards
// are at different migrations: there is no one step to show or revert.
var errShardsDiffer = errcode.Permanent("migrate_shards_differ", "the shards are at different migrations")

// Migrator applies the embedded migrations to one schema, or to the schema of
// every shard of a map. It records applied versions in <schema>.idem_migrations,
// refuses a database with a gap or with a version it does not know, and holds an
// advisory lock while it works, so two processes migrating at once apply each
// step once.
//
// With a shard map every method works on every shard, one after another in map
// order, each shard in its own transaction: a shard that fails does not stop the
// others, and the error names each shard that failed. Shard(name) is the Migrator
// of one shard.
type Migrator struct {
	parts  *fanout.Set[*part]
	schema string
}

// New returns a Migrator for cfg.Schema, or for every shard of cfg.Shards, or an
// error that wraps "invalid config".
func New(cfg Config) (*Migrator, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	migrations := Migrations()
	parts, err := fanout.Build(cfg.Shards, cfg, cfg.forShard, func(c Config) (*part, error) {
		return &part{cfg: c, migrations: migrations}, nil
	})
	if err != nil {
		return nil, err
	}
	for i, p := range parts.Parts() {
		p.name = parts.Name(i)
	}
	return &Migrator{parts: parts, schema: cfg.Schema}, nil
}

// Shard returns the Migrator of the named shard, or nil if the map has no such
// shard (or the Migrator has no map).
func (m *Migrator) Shard(name string) *Migrator {
	i := m.parts.IndexOf(name)
	if i < 0 || name == "" {
		return nil
	}
	p := m.parts.Part(i)
	one, err := fanout.Build[*part, *part](nil, p, nil, func(p *part) (*part, error) { return p, nil })
	if err != nil {
		return nil // build returns no error
	}
	return &Migrator{parts: one, schema: p.cfg.Schema}
}

// Schema is the schema the Migrator migrates ("" with a shard map: each shard
// names its own).
func (m *Migrator) Schema() string { return m.schema }

// Up applies every pending migration, in order, in one transaction. It returns the
// versions it applied; none when the schema is current, so calling it twice is safe.
// In Citus mode (Config.Citus, or a schema whose inbox is distributed) it then
// distributes the tables not yet distributed, in the same transaction.
// With a shard map it returns the versions applied on any shard (run Up again once
// the shards that failed are back: the shards already current apply nothing).
func (m *Migrator) Up(ctx context.Context) ([]int, error) {
	var all []int
	err := m.parts.Each(func(_ int, p *part) error {
		applied, err := p.up(ctx)
		for _, v := range applied {
			if !slices.Contains(all, v) {
				all = append(all, v)
			}
		}
		return err
	})
	slices.Sort(all)
	return all, err
}

// List returns every known migration and whether it is applied, with a shard map
// every migration of each shard in map order (Migration.Shard says which). It only
// reads: it runs in a READ ONLY transaction, takes no lock, and creates nothing, so
// it works for a read-only role or on a standby, and a schema that does not exist
// lists every migration as not applied.
func (m *Migrator) List(ctx context.Context) ([]Migration, error) {
	var out []Migration
	err := m.parts.Each(func(_ int, p *part) error {
		list, err := p.list(ctx)
		out = append(out, list...)
		return err
	})
	return out, err
}

// DownPlan is what reverting one migration does: the step, its SQL, and the
// tables its down file drops that exist now, with their rows. Over a shard map it
// holds every shard's tables and columns, each row naming its shard.
type DownPlan struct {
	// Version is 0 when no migration is applied: there is nothing to revert.
	Version int
	Name    string
	// SQL is the down migration, rendered for the schema (the first shard's, with
	// a shard map).
	SQL string
	// Tables are the tables it drops that exist, in the order it drops them, and
	// how many rows each holds (Shard: "" for one database).
	Tables []struct {
		Shard, Table string
		Rows         int64
	}
	// Columns are the columns it drops from tables it keeps (for example the stored
	// HTTP responses of migration 003), with how many rows hold a non-NULL value in
	// each: the data that goes with it.
	Columns []struct {
		Shard, Table, Column string
		Rows                 int64
	}
}

// tableRows and columnValues are the rows of DownPlan.Tables and DownPlan.Columns.
type (
	tableRows = struct {
		Shard, Table string
		Rows         int64
	}
	columnValues = struct {
		Shard, Table, Column string
		Rows                 int64
	}
)

// PlanDown says what Down would revert now, and what that would drop, counting
// the rows of each table. It only reads (in a READ ONLY transaction) and creates
// nothing, not even a missing schema. Over a shard map the shards must be at the
// same migration (code migrate_shards_differ otherwise).
func (m *Migrator) PlanDown(ctx context.Context) (DownPlan, error) {
	plans := make([]DownPlan, m.parts.Len())
	err := m.parts.Each(func(i int, p *part) (err error) {
		plans[i], err = p.planDown(ctx)
		return err
	})
	if err != nil {
		return DownPlan{}, err
	}
	return m.merge(plans)
}

// Revert reverts migration version, which must be the newest applied one (the
// Version of a PlanDown), and returns what it dropped, with the rows each table
// held when it was dropped (counted under an exclusive lock, so exactly). If
// the schema's newest migration is another one now, it reverts nothing and says
// so: a plan is never applied to a schema that changed after it was made. Over a
// shard map each shard at version reverts it; a shard at another migration
// reverts nothing, and the error names it.
func (m *Migrator) Revert(ctx context.Context, version int) (DownPlan, error) {
	if version < 1 {
		return DownPlan{}, fmt.Errorf("revert: version %d: a migration version starts at 1", version)
	}
	plans := make([]DownPlan, m.parts.Len())
	err := m.parts.Each(func(i int, p *part) (err error) {
		plans[i], err = p.revert(ctx, version)
		return err
	})
	if err != nil {
		return DownPlan{}, err
	}
	return m.merge(plans)
}

// Down reverts the newest applied migration, one step, without asking. It returns
// its version, or 0 when nothing was applied. A schema that does not exist (or has
// no migrations table) has nothing to revert, and Down creates nothing in it.
// PlanDown and Revert are the careful pair: look first, then revert exactly the
// step that was looked at. Over a shard map it reverts each shard's newest step
// and returns the newest version it reverted.
func (m *Migrator) Down(ctx context.Context) (int, error) {
	reverted := 0
	err := m.parts.Each(func(_ int, p *part) error {
		plan, err := p.revert(ctx, 0)
		reverted = max(reverted, plan.Version)
		return err
	})
	return reverted, err
}

// merge is the parts' plans, in map order, as one: they must be of one version.
func (m *Migrator) merge(plans []DownPlan) (DownPlan, error) {
	out := plans[0]
	for i, pl := range plans[1:] {
		if pl.Version != out.Version {
			return DownPlan{}, fmt.Errorf("%w: shard %q is at migration %d and shard %q at %d: bring them level (Up), or plan and revert each on its own (Shard(name))",
				errShardsDiffer, m.parts.Name(0), out.Version, m.parts.Name(i+1), pl.Version)
		}
		out.Tables = append(out.Tables, pl.Tables...)
		out.Columns = append(out.Columns, pl.Columns...)
	}
	return out, nil
}
