package effects

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/idem/internal/effectsdb"
)

// Tx is what Enqueue writes through: the handler's pgx.Tx, or any transaction.
type Tx interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Enqueue stores e in tx, the transaction that holds the business write, so the
// effect commits with it or not at all. The scope comes from ctx: in a consumer
// handler or an httpidem handler, the one the middleware put there (its schema,
// the message or request the effect comes from, its tenant, the allowed kinds);
// elsewhere, the Scope given to WithScope (DefaultSchema and no tenant without
// one).
//
// The effect's identity is (tenant, kind, key), tenant "" when unscoped. The insert
// is ON CONFLICT DO NOTHING: the same identity with the same payload is a no-op
// reported as Result{Duplicate: true}; with a different payload it is
// ErrFingerprintMismatch. A unique violation is never caught inside the
// transaction, because in Postgres that would abort it. In a consumer's
// group-commit batch the effect is checked now and written with the batch
// (Result{Deferred: true}).
func Enqueue(ctx context.Context, tx Tx, e Effect) (Result, error) {
	scope, _ := effectsdb.ScopeFrom(ctx)
	r, err := effectsdb.Enqueue(ctx, tx, scope, effectsdb.Effect(e))
	return Result(r), err
}

// EnqueueMany is Enqueue for many effects, in the scope ctx carries, with one
// statement: INSERT … SELECT FROM unnest(…) ON CONFLICT DO NOTHING, in (tenant,
// kind, key) order so that two writers that share keys cannot deadlock. results[i]
// is effs[i]'s. Validation errors come back before anything is written; errors of
// single effects (such as ErrFingerprintMismatch) come back together, and
// errors.Is and errors.As see each. On error, roll back: some of the effects may
// have been written. In a consumer's group-commit batch every effect is checked
// now and written with the batch (each Result Deferred).
func EnqueueMany(ctx context.Context, tx Tx, effs []Effect) ([]Result, error) {
	scope, _ := effectsdb.ScopeFrom(ctx)
	in := make([]effectsdb.Effect, len(effs))
	for i, e := range effs {
		in[i] = effectsdb.Effect(e)
	}
	rs, err := effectsdb.EnqueueMany(ctx, tx, scope, in)
	if rs == nil {
		return nil, err
	}
	out := make([]Result, len(rs))
	for i, r := range rs {
		out[i] = Result(r)
	}
	return out, err
}
