package admin

import (
	"cmp"
	"context"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/fanout"
)

// An action over a shard map (a requeue, a forget, a group's retry, discard or
// release) changes a tenant's rows only on the shard its route names: rows a
// tenant move left on another shard, or has not finished copying, are refused
// (ErrOffRoute), so that no failure is repaired twice.

// offRoute refuses an action (ErrOffRoute) when, on some shard, a tenant has rows
// it would change and the map's route names another shard for that tenant. read
// returns, on one part, the tenants of the rows the action would change there.
// With one database every tenant routes to it: nothing is read.
func (a *Admin) offRoute(ctx context.Context, what string, read func(ctx context.Context, p *part) ([]string, error)) error {
	tenant, on, want, errs, err := fanout.Stray(a.parts, func(_ int, p *part) ([]string, error) { return read(ctx, p) })
	if err := cmp.Or(a.join(errs), err); err != nil {
		return err
	}
	if on < 0 {
		return nil
	}
	from, to := a.parts.Name(on), a.parts.Name(want)
	return errorf(ErrOffRoute, "%s: tenant %q has rows it would change on shard %q, but the map routes the tenant to %q; nothing was changed. A tenant move left them there or is not finished: run it (again) with idem shard move-tenant --tenant %s --from %s --to %s, route the tenant to %s, then run this again",
		what, tenant, from, to, quoteArg(tenant), from, to, to)
}

// quoteArg quotes s for a shell command line when it needs it.
func quoteArg(s string) string {
	if s != "" && strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:/@") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// tenantsOf runs a statement that returns the tenants of the rows an action would
// change on one part.
func (a *part) tenantsOf(ctx context.Context, sql string, args ...any) ([]string, error) {
	rows, err := a.db.Query(ctx, sql, args...)
	if err != nil {
		return nil, a.wrap(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	return out, a.wrap(err)
}

// table is the quoted name of one of idem's tables in the part's schema.
func (a *part) table(name string) string { return pgx.Identifier{a.cfg.Schema, name}.Sanitize() }
