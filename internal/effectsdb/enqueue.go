// Package effectsdb is the enqueue engine of package effects: the rules an effect
// must pass and their coded errors, the Scope a handler's context carries (schema,
// source message, allowed kinds, and in a group-commit batch the Buffer), the
// writes of one effect and of many in one statement (EnqueueItems, the consumer's
// group-commit path), the stored form of a Watermill message, and the requeue of
// dead effects that admin runs. effects.Enqueue and effects.EnqueueMany read the
// scope from ctx and call it; the consumer and httpidem put their scope there. It
// imports nothing public of idem.
package effectsdb

import (
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/text"
)

// Limits on what Enqueue accepts.
const (
	// MaxKeyLen is the longest effect key, in bytes.
	MaxKeyLen = 512
	// MaxPayloadLen is the largest effect payload, in bytes.
	MaxPayloadLen = 8 << 20
	// DefaultMaxAttempts is how many times a sender tries an effect before it is dead.
	DefaultMaxAttempts = 25
)

// kindPattern is the rule for a kind, which ValidKind checks.
const kindPattern = `^[A-Za-z0-9][A-Za-z0-9_.:/@+-]{0,254}$`

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
	// Deferred: the effect was checked (kind, key, payload size, allowed kinds) and
	// put in the scope's Buffer, to be written with the rest of its group-commit
	// batch in one statement when the batch's handlers are done. Whether it is a
	// duplicate is not known yet (Duplicate is false); a fingerprint mismatch found
	// then fails the message that enqueued it, permanently (see Buffer).
	Deferred bool
}

// Source names the message that made an effect: its consumer, tenant and inbox key.
//
// Source.Tenant is also the effect's tenant. An effect's identity is (tenant, kind,
// key), with tenant "" when unscoped, so two tenants' "receipt:123" are two
// effects. The consumer middleware fills Source from the message. To enqueue for a
// tenant outside a consumer, set Tenant alone: without a Consumer no source is
// recorded, but the tenant still scopes the effect.
type Source struct {
	Consumer string
	Tenant   string
	Key      string
}

// Scope is what the consumer middleware puts in a handler's context for Enqueue: the
// schema, the message the effects come from, and optionally the kinds allowed.
type Scope struct {
	Schema string
	Source Source
	// Kinds, when not empty, are the only kinds Enqueue accepts (ErrUnknownKind).
	Kinds []string
	// Buffer, when set, makes Enqueue and EnqueueMany check each effect and add it
	// to the buffer instead of writing it (Result.Deferred). The consumer's
	// group-commit batches set it, and write every buffer of the batch with one
	// statement (EnqueueItems). To write at once and learn Duplicate or a mismatch
	// now, pass a copy of the scope with Buffer nil to Enqueue.
	Buffer *Buffer
	// Citus says the schema is distributed by Citus (the consumer and httpidem
	// set it from the mode they found): Enqueue then writes the row and raises
	// the dispatchers' notification with two statements that Citus routes as
	// they are, rather than one whose CTE it plans through the coordinator.
	Citus bool
}

type scopeKey struct{}

// WithScope returns a context that carries s for Enqueue.
func WithScope(ctx context.Context, s Scope) context.Context {
	return context.WithValue(ctx, scopeKey{}, s)
}

// ScopeFrom returns the Scope in ctx and whether there was one.
func ScopeFrom(ctx context.Context) (Scope, bool) {
	s, ok := ctx.Value(scopeKey{}).(Scope)
	return s, ok
}

// Tx is what Enqueue writes through: the handler's pgx.Tx.
type Tx interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Enqueue stores e in tx under scope, or, when the scope has a Buffer, checks e and
// adds it to the buffer (Result.Deferred). effects.Enqueue reads the scope from
// its context and calls it; its comment says what a caller sees.
func Enqueue(ctx context.Context, tx Tx, scope Scope, e Effect) (Result, error) {
	if tx == nil {
		return Result{}, ErrNoTx
	}
	schema, err := checkItem(scope, e)
	if err != nil {
		return Result{}, err
	}
	sc := trace.SpanContextFromContext(ctx)
	if scope.Buffer != nil {
		if err := scope.Buffer.add(scope, e, sc); err != nil {
			return Result{}, err
		}
		return Result{Deferred: true}, nil
	}
	maxAttempts := maxAttemptsOf(e)
	tc := EncodeTrace(sc)
	tenant := scope.Source.Tenant
	fp := sha256.Sum256(e.Payload)
	q := queriesFor(schema)
	var src [3]*string
	if scope.Source.Consumer != "" {
		// Copies, so that scope itself does not escape (it would cost the buffered
		// path above an allocation on every call).
		consumer, srcTenant, key := scope.Source.Consumer, scope.Source.Tenant, scope.Source.Key
		src = [3]*string{&consumer, &srcTenant, &key}
	}
	insert := q.insert
	if scope.Citus {
		insert = q.insertRouted
	}
	for {
		var inserted bool
		err := tx.QueryRow(ctx, insert, tenant, e.Kind, e.Key, e.Payload, fp[:], maxAttempts, e.Delay,
			src[0], src[1], src[2], tc).Scan(&inserted)
		if err == nil {
			if scope.Citus {
				if _, err := tx.Exec(ctx, q.notify); err != nil {
					return Result{}, pgschema.Wrap(err, schema)
				}
			}
			return Result{}, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return Result{}, pgschema.Wrap(err, schema)
		}
		// A conflict: the next statement sees the committed row (READ COMMITTED).
		var have []byte
		err = tx.QueryRow(ctx, q.fingerprint, tenant, e.Kind, e.Key).Scan(&have)
		if errors.Is(err, pgx.ErrNoRows) {
			continue // deleted in between by the janitor: insert again
		}
		if err != nil {
			return Result{}, pgschema.Wrap(err, schema)
		}
		if !bytes.Equal(have, fp[:]) {
			if tenant != "" {
				return Result{}, fmt.Errorf("%w: tenant %q kind %q key %q", ErrFingerprintMismatch, tenant, e.Kind, e.Key)
			}
			return Result{}, fmt.Errorf("%w: kind %q key %q", ErrFingerprintMismatch, e.Kind, e.Key)
		}
		return Result{Duplicate: true}, nil
	}
}

// checkItem validates an effect in its scope and returns the schema to write to.
func checkItem(scope Scope, e Effect) (string, error) {
	schema := cmp.Or(scope.Schema, pgschema.Default)
	if err := pgschema.Validate(schema); err != nil {
		return "", err
	}
	if err := ValidateEffect(e); err != nil {
		return "", err
	}
	if len(scope.Kinds) > 0 && !slices.Contains(scope.Kinds, e.Kind) {
		return "", fmt.Errorf("%w: %q (allowed: %s)", ErrUnknownKind, e.Kind, strings.Join(scope.Kinds, ", "))
	}
	if err := ValidateTenant(scope.Source.Tenant); err != nil {
		return "", err
	}
	return schema, nil
}

// ValidateTenant checks a tenant, the scope's or a Dispatcher's (ErrInvalidTenant).
func ValidateTenant(tenant string) error {
	if len(tenant) > MaxKeyLen || !text.Storable(tenant) {
		return fmt.Errorf("%w: %d bytes", ErrInvalidTenant, len(tenant))
	}
	return nil
}

func maxAttemptsOf(e Effect) int {
	if e.MaxAttempts <= 0 {
		return DefaultMaxAttempts
	}
	return e.MaxAttempts
}

// ValidateEffect checks an effect's kind, key and payload size.
func ValidateEffect(e Effect) error {
	if !ValidKind(e.Kind) {
		return fmt.Errorf("%w: got %q", ErrInvalidKind, e.Kind)
	}
	if e.Key == "" || len(e.Key) > MaxKeyLen || !text.Storable(e.Key) {
		return fmt.Errorf("%w: %d bytes", ErrInvalidKey, len(e.Key))
	}
	if len(e.Payload) > MaxPayloadLen {
		return fmt.Errorf("%w: %d bytes", ErrPayloadTooLarge, len(e.Payload))
	}
	return nil
}

// ValidKind reports whether s matches kindPattern, without the regexp machinery,
// which showed in the profile of a batch that enqueues an effect per message.
func ValidKind(s string) bool {
	if len(s) == 0 || len(s) > 255 {
		return false
	}
	for i := range len(s) {
		c := s[i]
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		case i > 0 && strings.IndexByte("_.:/@+-", c) >= 0:
		default:
			return false
		}
	}
	return true
}

// queriesCache holds the rendered statements of each schema, so that an
// Enqueue does not build its SQL again on every call.
var queriesCache sync.Map // schema -> *queries

func queriesFor(schema string) *queries {
	if q, ok := queriesCache.Load(schema); ok {
		return q.(*queries)
	}
	q := newQueries(schema)
	v, _ := queriesCache.LoadOrStore(schema, &q)
	return v.(*queries)
}
