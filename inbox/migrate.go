package inbox

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
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// MigrationsFS holds the numbered SQL files (NNN_name.up.sql and NNN_name.down.sql)
// for a migration tool of your own. Each "/* schema */" marker is a comment, so the
// files apply as they are, into the first schema of search_path.
func MigrationsFS() fs.FS {
	sub, _ := fs.Sub(migrationFiles, "migrations")
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

// Migrator applies the embedded migrations to one schema. It records applied
// versions in <schema>.idem_migrations, refuses a database with a gap or with a
// version it does not know, and holds an advisory lock while it works, so two
// processes migrating at once apply each step once.
type Migrator struct {
	db         Beginner
	schema     string
	migrations []Migration
}

// NewMigrator returns a Migrator for schema (DefaultSchema when empty).
func NewMigrator(db Beginner, schema string) (*Migrator, error) {
	if schema == "" {
		schema = DefaultSchema
	}
	if err := ValidateSchema(schema); err != nil {
		return nil, err
	}
	return &Migrator{db: db, schema: schema, migrations: Migrations()}, nil
}

// MigrationStatus is one known migration and whether the database has it.
type MigrationStatus struct {
	Version   int
	Name      string
	Applied   bool
	AppliedAt time.Time
}

// Up applies every pending migration, in order, in one transaction. It returns the
// versions it applied; none when the schema is current, so calling it twice is safe.
func (m *Migrator) Up(ctx context.Context) ([]int, error) {
	var applied []int
	err := m.locked(ctx, func(tx pgx.Tx, have []int) error {
		for _, mig := range m.migrations[len(have):] {
			if _, err := tx.Exec(ctx, m.render(mig.Up)); err != nil {
				return fmt.Errorf("apply migration %03d_%s: %w", mig.Version, mig.Name, err)
			}
			if _, err := tx.Exec(ctx, `INSERT INTO `+quoteIdent(m.schema)+`.idem_migrations (version, name) VALUES ($1, $2)`, mig.Version, mig.Name); err != nil {
				return err
			}
			applied = append(applied, mig.Version)
		}
		return nil
	})
	return applied, err
}

// Down reverts the newest applied migration, one step. It returns its version, or 0
// when nothing was applied.
func (m *Migrator) Down(ctx context.Context) (int, error) {
	var reverted int
	err := m.locked(ctx, func(tx pgx.Tx, have []int) error {
		if len(have) == 0 {
			return nil
		}
		mig := m.migrations[len(have)-1]
		if _, err := tx.Exec(ctx, m.render(mig.Down)); err != nil {
			return fmt.Errorf("revert migration %03d_%s: %w", mig.Version, mig.Name, err)
		}
		if _, err := tx.Exec(ctx, `DELETE FROM `+quoteIdent(m.schema)+`.idem_migrations WHERE version = $1`, mig.Version); err != nil {
			return err
		}
		reverted = mig.Version
		return nil
	})
	return reverted, err
}

// List returns every known migration and whether it is applied.
func (m *Migrator) List(ctx context.Context) ([]MigrationStatus, error) {
	var out []MigrationStatus
	err := m.locked(ctx, func(tx pgx.Tx, have []int) error {
		times := map[int]time.Time{}
		rows, err := tx.Query(ctx, `SELECT version, applied_at FROM `+quoteIdent(m.schema)+`.idem_migrations`)
		if err != nil {
			return err
		}
		for rows.Next() {
			var v int
			var at time.Time
			if err := rows.Scan(&v, &at); err != nil {
				return err
			}
			times[v] = at
		}
		if err := rows.Err(); err != nil {
			return err
		}
		for _, mig := range m.migrations {
			at, ok := times[mig.Version]
			out = append(out, MigrationStatus{Version: mig.Version, Name: mig.Name, Applied: ok, AppliedAt: at})
		}
		return nil
	})
	return out, err
}

// locked runs fn in a transaction that holds the schema's migration lock, with the
// applied versions, after checking they are a gap-free prefix of the known ones.
func (m *Migrator) locked(ctx context.Context, fn func(tx pgx.Tx, have []int) error) error {
	return pgx.BeginFunc(ctx, m.db, func(tx pgx.Tx) error {
		// The lock is taken before CREATE SCHEMA: two processes creating one schema
		// at once would otherwise collide on the catalog's unique index.
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtextextended('idem.migrate:' || $1, 0))`, m.schema); err != nil {
			return err
		}
		q := quoteIdent(m.schema)
		if _, err := tx.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS `+q); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+q+`.idem_migrations (
			version    integer PRIMARY KEY,
			name       text NOT NULL,
			applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
			return err
		}
		rows, err := tx.Query(ctx, `SELECT version FROM `+q+`.idem_migrations ORDER BY version`)
		if err != nil {
			return err
		}
		have, err := pgx.CollectRows(rows, pgx.RowTo[int])
		if err != nil {
			return err
		}
		for i, v := range have {
			if v > len(m.migrations) {
				return fmt.Errorf("schema %s is at migration %d, newer than this build knows (%d): upgrade idem", m.schema, slices.Max(have), len(m.migrations))
			}
			if v != i+1 {
				return fmt.Errorf("schema %s has a gap in its applied migrations: %v; refusing to migrate", m.schema, have)
			}
		}
		return fn(tx, have)
	})
}

func (m *Migrator) render(sql string) string {
	return strings.ReplaceAll(sql, schemaMarker, quoteIdent(m.schema)+".")
}

func quoteIdent(s string) string { return pgx.Identifier{s}.Sanitize() }

// errIsUndefinedTable reports a missing table (42P01), which means the migrations
// have not run.
func errIsUndefinedTable(err error) bool {
	var pgErr interface{ SQLState() string }
	return errors.As(err, &pgErr) && pgErr.SQLState() == "42P01"
}
