package effects

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"regexp"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Execer runs a statement: a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx.
type Execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// LedgerConfig names the user table a LedgerSender writes to.
type LedgerConfig struct {
	// Table is "table" or "schema.table", in lower-case identifiers.
	Table string
	// KeyColumn holds the effect key and must be unique (a primary key or a unique
	// constraint) (default "effect_key").
	KeyColumn string
	// PayloadColumn receives the effect payload (default "payload"). A bytea column
	// takes any payload; a json or jsonb column takes a JSON payload.
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

var identRe = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

// LedgerSender writes each effect as one row of a user table, keyed by the effect
// key (and its tenant, with a TenantColumn): INSERT … ON CONFLICT (key) DO NOTHING.
// It is idempotent by construction, so a repeated attempt changes nothing. Use it
// for local effects, such as ledger entries kept in another database or schema than
// the business write.
func LedgerSender(db Execer, cfg LedgerConfig) (Sender, error) {
	if db == nil {
		return nil, fmt.Errorf("invalid config: ledger db is nil")
	}
	cfg.KeyColumn = cmp.Or(cfg.KeyColumn, "effect_key")
	cfg.PayloadColumn = cmp.Or(cfg.PayloadColumn, "payload")
	parts := strings.Split(cfg.Table, ".")
	idents := append(parts[:len(parts):len(parts)], cfg.KeyColumn, cfg.PayloadColumn)
	if cfg.KindColumn != "" {
		idents = append(idents, cfg.KindColumn)
	}
	if cfg.TenantColumn != "" {
		idents = append(idents, cfg.TenantColumn)
	}
	if len(parts) > 2 {
		return nil, fmt.Errorf("invalid config: ledger table %q: want table or schema.table", cfg.Table)
	}
	for _, id := range idents {
		if !identRe.MatchString(id) {
			return nil, fmt.Errorf("invalid config: ledger identifier %q must match %s", id, identRe)
		}
	}
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
	return SenderFunc(func(ctx context.Context, d Delivery) error {
		args := []any{d.Key, d.Payload}
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
