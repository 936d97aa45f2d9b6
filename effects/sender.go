package effects

import (
	"context"
	"errors"
	"time"
)

// Delivery is one attempt at an effect, as a Sender sees it. Tenant, Kind and Key are
// the same on every attempt: a receiver that honours idempotency keys applies the
// effect once however often it is sent.
type Delivery struct {
	// Tenant is the tenant the effect belongs to, "" when unscoped. The effect's
	// identity is (Tenant, Kind, Key): two tenants may each have an effect with the
	// same Key. A Sender whose receiver is shared by tenants must pass the tenant on
	// with the key (a tenant column next to the key column, a tenant header), or
	// tenant B's effect would be taken for a repeat of tenant A's.
	Tenant string
	// Kind names the sender ("email", "publish:orders").
	Kind string
	// Key is the effect's stable identity within its tenant. Pass it to the
	// receiver as its idempotency key (an Idempotency-Key header, a Message-ID, a
	// unique column), with Tenant when the receiver serves several tenants.
	Key string
	// Payload is what Enqueue stored.
	Payload []byte
	// Attempt counts from 1. An attempt whose outcome was unknown still counts.
	Attempt int
	// CreatedAt is when the effect was enqueued (the database's clock).
	CreatedAt time.Time
	// SourceConsumer, SourceTenant and SourceKey name the message (or HTTP
	// request) that made the effect: its consumer, tenant and inbox key. They are
	// empty when the effect was enqueued outside a consumer or httpidem handler.
	SourceConsumer, SourceTenant, SourceKey string
}

// Sender carries out effects of one kind.
//
// Send must honour ctx: its deadline ends before the claim's lease does, and a
// sender that keeps going past its lease may run at the same moment as another
// dispatcher's retry of the same effect. Return nil once the receiver has the
// effect, Permanent(err) when retrying cannot help, Indefinite(err) when the call
// may or may not have taken effect, and any other error to retry later.
type Sender interface {
	Send(ctx context.Context, d Delivery) error
}

// SenderFunc adapts a function to Sender.
type SenderFunc func(ctx context.Context, d Delivery) error

// Send calls f.
func (f SenderFunc) Send(ctx context.Context, d Delivery) error { return f(ctx, d) }

// Reconciler is implemented by a Sender whose receiver can be asked whether an
// effect already took place, for receivers that have a query API but no
// idempotency keys.
//
// The Dispatcher calls Reconcile before it retries an attempt whose outcome is
// unknown: the lease of a claim ran out (its process died or stalled mid-send), or
// the last Send returned an Indefinite error. done=true marks the effect done without
// another Send; done=false with a nil error means it did not happen, and Send runs.
// An error leaves the outcome unknown: the effect is counted in
// idem_effects_unknown_total and tried again later, never guessed.
type Reconciler interface {
	Reconcile(ctx context.Context, d Delivery) (done bool, err error)
}

// Permanent marks err as a failure that retrying cannot fix: the Dispatcher makes
// the effect dead at once, with err as its last_error. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err}
}

// Indefinite marks err as an attempt whose outcome is unknown: the call may have
// reached the receiver (a timeout after the request was written, a connection cut
// before the reply). The effect is retried with backoff, and a Sender that is also
// a Reconciler is asked first whether it took effect. Indefinite(nil) is nil.
func Indefinite(err error) error {
	if err == nil {
		return nil
	}
	return &indefiniteError{err}
}

// isIndefinite reports whether err is marked Indefinite.
func isIndefinite(err error) bool {
	var i *indefiniteError
	return errors.As(err, &i)
}

type permanentError struct{ err error }

func (e *permanentError) Error() string   { return e.err.Error() }
func (e *permanentError) Unwrap() error   { return e.err }
func (e *permanentError) Permanent() bool { return true }

type indefiniteError struct{ err error }

func (e *indefiniteError) Error() string { return e.err.Error() }
func (e *indefiniteError) Unwrap() error { return e.err }
