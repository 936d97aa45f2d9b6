package effectsdb

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/pgschema"
)

// Querier is what the requeue functions run on: a *pgxpool.Pool, a *pgx.Conn or a
// pgx.Tx.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// RequeueFilter picks the dead effects to bring back. Set Kind, Key, Tenant or any
// of them together; or All to take every dead effect. An empty filter is refused, so
// that a forgotten field cannot requeue everything.
type RequeueFilter struct {
	Kind string
	Key  string
	// Tenant, when set, takes only that tenant's effects. Empty means every tenant
	// (the unscoped effects included): a Key alone may name one effect per tenant.
	Tenant string
	// TenantExact makes Tenant match exactly, the empty tenant included: with it, an
	// empty Tenant takes only the unscoped effects, never another tenant's. Use it to
	// requeue one effect by its whole identity (tenant, kind, key).
	TenantExact bool
	All         bool
}

// RequeueDead brings dead effects back to pending: attempts start again from 0,
// they are due now, and dispatchers are notified. It returns how many it
// requeued. An effect whose last outcome was unknown keeps that mark, so its
// Reconciler is asked before it is sent again. Run it on a pool, or inside a
// transaction of your own (the notification is delivered when it commits).
func RequeueDead(ctx context.Context, db Querier, schema string, f RequeueFilter) (int64, error) {
	if schema == "" {
		schema = pgschema.Default
	}
	if err := pgschema.Validate(schema); err != nil {
		return 0, err
	}
	if f.Kind == "" && f.Key == "" && f.Tenant == "" && !f.TenantExact && !f.All {
		return 0, errors.New("idem: requeue needs a kind, a key, a tenant, or All")
	}
	var n int64
	err := db.QueryRow(ctx, queriesFor(schema).requeue, f.Kind, f.Key, schema, f.Tenant, f.TenantExact).Scan(&n, nil)
	if err != nil {
		return 0, pgschema.Wrap(err, schema)
	}
	return n, nil
}
