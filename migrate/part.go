package migrate

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/pgschema"
)

// part is the Migrator of one database: one of a shard map's, or the only one.
// Every operation on a database lives here; the Migrator runs it on each part.
type part struct {
	cfg        Config // one database: Pool and Schema set, Shards nil
	name       string // the shard's name; "" for the part of one database
	migrations []Migration
}

// up applies every pending migration, in order, in one transaction, and returns
// the versions it applied; in Citus mode it then distributes the tables (distribute).
func (p *part) up(ctx context.Context) ([]int, error) {
	var applied []int
	err := p.locked(ctx, true, func(tx pgx.Tx, have []int) error {
		for _, mig := range p.migrations[len(have):] {
			if _, err := tx.Exec(ctx, p.render(mig.Up)); err != nil {
				return fmt.Errorf("apply migration %03d_%s: %w", mig.Version, mig.Name, err)
			}
			if _, err := tx.Exec(ctx, `INSERT INTO `+pgschema.Quote(p.cfg.Schema)+`.idem_migrations (version, name) VALUES ($1, $2)`, mig.Version, mig.Name); err != nil {
				return err
			}
			applied = append(applied, mig.Version)
		}
		return p.distribute(ctx, tx)
	})
	return applied, err
}

// list returns every known migration and whether it is applied, in a READ ONLY
// transaction.
func (p *part) list(ctx context.Context) ([]Migration, error) {
	var out []Migration
	err := p.readOnly(ctx, func(_ pgx.Tx, _ []int, times map[int]time.Time) error {
		for _, mig := range p.migrations {
			mig.AppliedAt, mig.Applied = times[mig.Version]
			mig.Shard = p.name
			out = append(out, mig)
		}
		return nil
	})
	return out, err
}

// planDown says what reverting the newest migration would drop, in a READ ONLY
// transaction.
func (p *part) planDown(ctx context.Context) (DownPlan, error) {
	var plan DownPlan
	err := p.readOnly(ctx, func(tx pgx.Tx, have []int, _ map[int]time.Time) error {
		if len(have) == 0 {
			return nil
		}
		var err error
		plan, err = p.plan(ctx, tx, p.migrations[len(have)-1], false)
		return err
	})
	return plan, err
}

// revert reverts the newest migration, which must be version unless version is 0.
func (p *part) revert(ctx context.Context, version int) (DownPlan, error) {
	var plan DownPlan
	err := p.locked(ctx, false, func(tx pgx.Tx, have []int) error {
		newest := len(have)
		if version != 0 && newest != version {
			return fmt.Errorf("schema %s is at migration %d now, not %d: another process migrated it; look again (idem migrate list) before reverting", p.cfg.Schema, newest, version)
		}
		if newest == 0 {
			return nil
		}
		mig := p.migrations[newest-1]
		var err error
		if plan, err = p.plan(ctx, tx, mig, true); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, plan.SQL); err != nil {
			return fmt.Errorf("revert migration %03d_%s: %w", mig.Version, mig.Name, err)
		}
		if _, err := tx.Exec(ctx, `DELETE FROM `+pgschema.Quote(p.cfg.Schema)+`.idem_migrations WHERE version = $1`, mig.Version); err != nil {
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
func (p *part) plan(ctx context.Context, tx pgx.Tx, mig Migration, lock bool) (DownPlan, error) {
	plan := DownPlan{Version: mig.Version, Name: mig.Name, SQL: p.render(mig.Down)}
	for _, table := range droppedTables(mig.Down) {
		rows, found, err := p.count(ctx, tx, lock, table, "", `SELECT to_regclass($1) IS NOT NULL`, pgschema.Table(p.cfg.Schema, table))
		if err != nil {
			return plan, err
		}
		if found {
			plan.Tables = append(plan.Tables, tableRows{Shard: p.name, Table: table, Rows: rows})
		}
	}
	for _, c := range droppedColumns(mig.Down) {
		rows, found, err := p.count(ctx, tx, lock, c.Table, c.Column, `SELECT EXISTS (SELECT 1 FROM information_schema.columns
			WHERE table_schema = $1 AND table_name = $2 AND column_name = $3)`, p.cfg.Schema, c.Table, c.Column)
		if err != nil {
			return plan, err
		}
		if found {
			c.Shard, c.Rows = p.name, rows
			plan.Columns = append(plan.Columns, c)
		}
	}
	return plan, nil
}

// count counts the rows of table, or its rows with a value in column when column is
// set, if exists (a statement that answers one bool, with its args) says the table
// or column is there; found is false otherwise. With lock, it takes the lock DROP
// would take first.
func (p *part) count(ctx context.Context, tx pgx.Tx, lock bool, table, column, exists string, args ...any) (rows int64, found bool, err error) {
	if err := tx.QueryRow(ctx, exists, args...).Scan(&found); err != nil || !found {
		return 0, false, err
	}
	name := pgschema.Table(p.cfg.Schema, table)
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
func droppedColumns(downSQL string) []columnValues {
	var out []columnValues
	for _, stmt := range alterTableStmt.FindAllStringSubmatch(downSQL, -1) {
		for _, c := range dropColumn.FindAllStringSubmatch(stmt[2], -1) {
			out = append(out, columnValues{Table: stmt[1], Column: c[1]})
		}
	}
	return out
}

// readCommitted runs fn in a transaction at READ COMMITTED, whatever the session's
// default_transaction_isolation says. Under REPEATABLE READ or SERIALIZABLE the
// snapshot is taken by the transaction's first statement, the lock, before it
// waits: a migrator that waited for another would not see the versions that one
// applied, and would apply them again. (A db that can only Begin, such as a pgx.Tx,
// gets a savepoint in the caller's transaction, at the caller's isolation.)
func (p *part) readCommitted(ctx context.Context, fn func(tx pgx.Tx) error) error {
	if b, ok := p.cfg.Pool.(interface {
		BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
	}); ok {
		return pgx.BeginTxFunc(ctx, b, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, fn)
	}
	return pgx.BeginFunc(ctx, p.cfg.Pool, fn)
}

// readOnly runs fn in a READ ONLY transaction with the applied versions.
func (p *part) readOnly(ctx context.Context, fn func(tx pgx.Tx, have []int, times map[int]time.Time) error) error {
	return pgx.BeginFunc(ctx, p.cfg.Pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SET TRANSACTION READ ONLY`); err != nil {
			return err
		}
		have, times, err := p.applied(ctx, tx)
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
func (p *part) locked(ctx context.Context, create bool, fn func(tx pgx.Tx, have []int) error) error {
	return p.readCommitted(ctx, func(tx pgx.Tx) error {
		// The lock is taken before CREATE SCHEMA: two processes creating one schema
		// at once would otherwise collide on the catalog's unique index.
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtextextended('idem.migrate:' || $1, 0))`, p.cfg.Schema); err != nil {
			return err
		}
		if create {
			q := pgschema.Quote(p.cfg.Schema)
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
		have, _, err := p.applied(ctx, tx)
		if err != nil {
			return err
		}
		return fn(tx, have)
	})
}

// applied reads the applied versions and when each was applied: none when the
// schema or its migrations table does not exist. It refuses versions this build
// does not know and gaps.
func (p *part) applied(ctx context.Context, tx pgx.Tx) ([]int, map[int]time.Time, error) {
	table := pgschema.Quote(p.cfg.Schema) + ".idem_migrations"
	var exists bool
	if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, table).Scan(&exists); err != nil {
		return nil, nil, err
	}
	times := map[int]time.Time{}
	if !exists {
		return nil, times, p.otherTool(ctx, tx)
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
	if len(have) == 0 {
		if err := p.otherTool(ctx, tx); err != nil {
			return nil, nil, err
		}
	}
	for i, v := range have {
		if v > len(p.migrations) {
			return nil, nil, fmt.Errorf("schema %s is at migration %d, newer than this build knows (%d): upgrade idem", p.cfg.Schema, slices.Max(have), len(p.migrations))
		}
		if v != i+1 {
			return nil, nil, fmt.Errorf("schema %s has a gap in its applied migrations: %v; refusing to migrate", p.cfg.Schema, have)
		}
	}
	return have, times, nil
}

// otherTools are the migration tools whose version tables otherTool looks for,
// with how to read the version and what to run instead.
var otherTools = []struct {
	name, table, version, instead string
}{
	{"goose", "goose_db_version", `SELECT coalesce(max(version_id), 0) FROM %s WHERE is_applied`,
		"run goose with idem's goose files instead (migrate.GooseMigrationsFS, or migrate/migrations/goose in idem's module): " +
			`goose -dir "$IDEM/migrate/migrations/goose" postgres "$DATABASE_URL&search_path=%s" up`},
	{"golang-migrate", "schema_migrations", `SELECT coalesce(max(version), 0) FROM %s`,
		"run golang-migrate with idem's files instead (migrate.MigrationsFS, or migrate/migrations in idem's module): " +
			`migrate -path "$IDEM/migrate/migrations" -database "pgx5://USER@HOST:PORT/DB?sslmode=…&search_path=%s" up`},
}

// otherTool returns ErrManagedElsewhere when the schema holds idem's tables (its
// inbox) while idem's migrator recorded none of its migrations; it is called only
// then. It names the tool whose version table it finds, in the schema first, then
// in search_path.
func (p *part) otherTool(ctx context.Context, tx pgx.Tx) error {
	var has bool
	if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, pgschema.Table(p.cfg.Schema, "inbox")).Scan(&has); err != nil || !has {
		return err
	}
	for _, t := range otherTools {
		for _, name := range []string{pgschema.Table(p.cfg.Schema, t.table), pgschema.Quote(t.table)} {
			var where *string
			if err := tx.QueryRow(ctx, `SELECT n.nspname FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
				WHERE c.oid = to_regclass($1)`, name).Scan(&where); err != nil && !errors.Is(err, pgx.ErrNoRows) {
				return err
			}
			if where == nil {
				continue
			}
			table := *where + "." + t.table // plain identifiers (pgschema.Valid, and the tools' names)
			var version int64
			if err := tx.QueryRow(ctx, fmt.Sprintf(t.version, pgschema.Table(*where, t.table))).Scan(&version); err != nil {
				return fmt.Errorf("%w: schema %s holds idem's tables and %s, %s's version table, which could not be read: %v",
					ErrManagedElsewhere, p.cfg.Schema, table, t.name, err)
			}
			return fmt.Errorf("%w: schema %s is managed by %s: its table %s is at version %d, and idem's migrator has no record of its own (%s.idem_migrations), so it would apply every migration again; %s (docs/migrations.md)",
				ErrManagedElsewhere, p.cfg.Schema, t.name, table, version, p.cfg.Schema, fmt.Sprintf(t.instead, p.cfg.Schema))
		}
	}
	return fmt.Errorf("%w: schema %s holds idem's tables, but idem's migrator has no record of its own (%s.idem_migrations) and no goose_db_version or schema_migrations table is found, in the schema or in search_path: another tool or a person applied them; migrate it with that tool, keeping one tool per schema (docs/migrations.md)",
		ErrManagedElsewhere, p.cfg.Schema, p.cfg.Schema)
}

func (p *part) render(sql string) string {
	return strings.ReplaceAll(sql, schemaMarker, pgschema.Quote(p.cfg.Schema)+".")
}
