package effects

import (
	"context"
	"time"

	"github.com/idemkit/idem/internal/effectsdb"
)

// Effect is a side effect to carry out after the transaction commits.
type Effect struct {
	// Kind names the sender that carries it out: "email", "ledger",
	// "publish:orders".
	Kind string
	// Key is the effect's stable identity, such as "receipt:pay_789". Every attempt
	// passes it to the sender, so a receiver that honours idempotency keys applies
	// the effect once.
	Key string
	// Payload is what the sender needs. It is stored as it is.
	Payload []byte
	// MaxAttempts caps the attempts (DefaultMaxAttempts if 0).
	MaxAttempts int
	// Delay holds the effect back: it is due at the database's clock_timestamp()
	// when Enqueue's INSERT runs, plus Delay, so never earlier than Delay after the
	// Enqueue call. The wait counts from the call, not from the commit: an effect
	// can never be sent before its transaction commits, so when the transaction
	// runs on for longer than Delay after the call, the effect is due as soon as it
	// commits. 0 means due at once.
	Delay time.Duration
}

// Result says what Enqueue did.
type Result struct {
	// Duplicate: the same (tenant, kind, key) with the same payload was already
	// there; nothing was written.
	Duplicate bool
	// Deferred: in a consumer's group-commit batch, the effect was checked (kind,
	// key, payload size, allowed kinds) and is written with the rest of the batch in
	// one statement when the batch's handlers are done. Whether it is a duplicate is
	// not known yet (Duplicate is false); a fingerprint mismatch found then fails
	// the message that enqueued it, permanently, and rolls back its work.
	Deferred bool
}

// Scope is what code outside a consumer or httpidem handler gives Enqueue and
// EnqueueMany, through WithScope: the schema that holds the idem tables
// (DefaultSchema if empty) and the tenant the effects belong to ("" for none). An
// effect's identity is (tenant, kind, key), so two tenants' "receipt:123" are two
// effects. In a handler of the consumer or of httpidem, the middleware has put the
// scope in the context already, with the message or request the effects come from.
type Scope struct {
	Schema string
	Tenant string
}

// WithScope returns a context that carries s for Enqueue and EnqueueMany. In a
// consumer or httpidem handler it replaces the middleware's scope, so the effects
// lose their source and are written at once, outside any group-commit batch.
func WithScope(ctx context.Context, s Scope) context.Context {
	return effectsdb.WithScope(ctx, effectsdb.Scope{Schema: s.Schema, Source: effectsdb.Source{Tenant: s.Tenant}})
}
