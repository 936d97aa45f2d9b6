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
}

var identRe = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

// LedgerSender writes each effect as one row of a user table, keyed by the effect
// key: INSERT … ON CONFLICT (key) DO NOTHING. It is idempotent by construction, so
// a repeated attempt changes nothing. Use it for local effects, such as ledger
// entries kept in another database or schema than the business write.
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
	if len(parts) > 2 {
		return nil, fmt.Errorf("invalid config: ledger table %q: want table or schema.table", cfg.Table)
	}
	for _, id := range idents {
		if !identRe.MatchString(id) {
			return nil, fmt.Errorf("invalid config: ledger identifier %q must match %s", id, identRe)
		}
	}
	table := pgx.Identifier(parts).Sanitize()
	cols := pgx.Identifier{cfg.KeyColumn}.Sanitize() + ", " + pgx.Identifier{cfg.PayloadColumn}.Sanitize()
	vals := "$1, $2"
	if cfg.KindColumn != "" {
		cols += ", " + pgx.Identifier{cfg.KindColumn}.Sanitize()
		vals += ", $3"
	}
	sql := `INSERT INTO ` + table + ` (` + cols + `) VALUES (` + vals + `) ON CONFLICT (` +
		pgx.Identifier{cfg.KeyColumn}.Sanitize() + `) DO NOTHING`
	withKind := cfg.KindColumn != ""
	return SenderFunc(func(ctx context.Context, d Delivery) error {
		args := []any{d.Key, d.Payload}
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
