package effects

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/pgschema"
)

// execer runs a statement: a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx.
type execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// LedgerConfig configures a ledger sender: the database and the user table it
// writes to.
type LedgerConfig struct {
	// Pool runs the inserts: a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx. Required.
	Pool execer
	// Table is "table" or "schema.table", in lower-case identifiers. Required.
	Table string
	// KeyColumn holds the effect key and must be unique (a primary key or a unique
	// constraint) (default "effect_key").
	KeyColumn string
	// PayloadColumn receives the effect payload (default "payload"). A bytea column
	// takes any payload; a json or jsonb column takes a JSON payload, a text column
	// UTF-8 text. The sender reads the column's type from the catalog at its first
	// send and passes the payload as bytes to a bytea column and as text to any
	// other, so it works in every pgx QueryExecMode (simple protocol and exec, as
	// used behind PgBouncer, included), where a []byte is always sent as bytea.
	PayloadColumn string
	// KindColumn, when set, receives the effect kind too.
	KindColumn string
	// TenantColumn, when set, receives the effect's tenant ("" when unscoped), and
	// the row is keyed by (TenantColumn, KeyColumn): the unique constraint must be
	// on those two columns. Set it when tenant-scoped effects write to the table:
	// without it, an effect that has a tenant is refused (a permanent error), since
	// keyed by its key alone it would be taken for another tenant's effect with the
	// same key and silently dropped.
	TenantColumn string
}

// WithDefaults returns c with every unset field at its default.
func (c LedgerConfig) WithDefaults() LedgerConfig {
	c.KeyColumn = cmp.Or(c.KeyColumn, DefaultLedgerKeyColumn)
	c.PayloadColumn = cmp.Or(c.PayloadColumn, DefaultLedgerPayloadColumn)
	return c
}

// Validate reports what NewLedgerSender would refuse in c: no Pool, a table or
// column name that is not a plain lower-case identifier. It checks
// c.WithDefaults(), so a config with a Pool and a Table passes.
func (c LedgerConfig) Validate() error {
	c = c.WithDefaults()
	if c.Pool == nil {
		return errcode.InvalidConfig("Pool is required")
	}
	parts := strings.Split(c.Table, ".")
	if len(parts) > 2 {
		return errcode.InvalidConfig("ledger table %q: want table or schema.table", c.Table)
	}
	idents := slices.Concat(parts, []string{c.KeyColumn, c.PayloadColumn})
	for _, optional := range []string{c.KindColumn, c.TenantColumn} {
		if optional != "" {
			idents = append(idents, optional)
		}
	}
	for _, id := range idents {
		if !pgschema.Valid(id) {
			return errcode.InvalidConfig("ledger identifier %q must match ^[a-z_][a-z0-9_]{0,62}$", id)
		}
	}
	return nil
}

// NewLedgerSender returns a Sender that writes each effect as one row of a user
// table, keyed by the effect key (and its tenant, with a TenantColumn): INSERT …
// ON CONFLICT (key) DO NOTHING. It is idempotent by construction, so a repeated
// attempt changes nothing. Use it for local effects, such as ledger entries kept in
// another database or schema than the business write.
func NewLedgerSender(cfg LedgerConfig) (Sender, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	db := cfg.Pool
	parts := strings.Split(cfg.Table, ".")
	q := func(id string) string { return pgx.Identifier{id}.Sanitize() }
	table := pgx.Identifier(parts).Sanitize()
	cols := q(cfg.KeyColumn) + ", " + q(cfg.PayloadColumn)
	vals := "$1, $2"
	conflict := q(cfg.KeyColumn)
	if cfg.TenantColumn != "" {
		cols += ", " + q(cfg.TenantColumn)
		vals += ", $3"
		conflict = q(cfg.TenantColumn) + ", " + conflict
	}
	if cfg.KindColumn != "" {
		cols += ", " + q(cfg.KindColumn)
		vals += fmt.Sprintf(", $%d", strings.Count(vals, "$")+1)
	}
	sql := `INSERT INTO ` + table + ` (` + cols + `) VALUES (` + vals + `) ON CONFLICT (` + conflict + `) DO NOTHING`
	withKind, withTenant := cfg.KindColumn != "", cfg.TenantColumn != ""
	payloadType := &columnType{db: db, table: table, column: cfg.PayloadColumn}
	return SenderFunc(func(ctx context.Context, d Delivery) error {
		var payload any = d.Payload
		if binary, err := payloadType.isBytea(ctx); err != nil {
			return err
		} else if !binary && d.Payload != nil {
			payload = string(d.Payload)
		}
		args := []any{d.Key, payload}
		if withTenant {
			args = append(args, d.Tenant)
		} else if d.Tenant != "" {
			return Permanent(fmt.Errorf("effect of tenant %q: the ledger table %s has no tenant column, and keyed by %q alone "+
				"it would collide with other tenants' effects; add a tenant column to the unique key and set LedgerConfig.TenantColumn",
				d.Tenant, cfg.Table, cfg.KeyColumn))
		}
		if withKind {
			args = append(args, d.Kind)
		}
		_, err := db.Exec(ctx, sql, args...)
		if isPermanentPgError(err) {
			return Permanent(err)
		}
		return err
	}), nil
}

// isPermanentPgError is true for errors that the same statement will hit again:
// a missing table or column, a type mismatch, a constraint the row breaks.
func isPermanentPgError(err error) bool {
	var pgErr *pgconn.PgError
	if err == nil || !errors.As(err, &pgErr) {
		return false
	}
	switch pgErr.Code[:2] {
	case "22", "23", "42": // data exception, integrity violation, syntax/undefined
		return true
	}
	return false
}

// columnType finds out, once, whether a ledger's payload column is bytea. pgx sends
// a []byte argument as bytea in the simple-protocol and exec query modes (it knows
// the parameter's type only in the modes that describe statements), so a json,
// jsonb or text column must be given a string instead.
type columnType struct {
	db            execer
	table, column string

	mu     sync.Mutex
	known  bool
	binary bool
}

// columnTypeSQL is the column's base type (a domain's too): true for bytea. No row
// (no such table or column) leaves the INSERT to fail with Postgres's own error.
const columnTypeSQL = `SELECT coalesce(nullif(t.typbasetype, 0), t.oid) = 'bytea'::regtype
	FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
	WHERE a.attrelid = to_regclass($1) AND a.attname = $2 AND a.attnum > 0 AND NOT a.attisdropped`

func (c *columnType) isBytea(ctx context.Context) (bool, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.known {
		return c.binary, nil
	}
	q, ok := c.db.(interface {
		QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	})
	if !ok {
		return true, nil // an execer that cannot query: bytes, as before
	}
	err := q.QueryRow(ctx, columnTypeSQL, c.table, c.column).Scan(&c.binary)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return true, nil // not cached: the table may be created later
	case err != nil:
		return false, fmt.Errorf("read the type of ledger column %s.%s: %w", c.table, c.column, err)
	}
	c.known = true
	return c.binary, nil
}
