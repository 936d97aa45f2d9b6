package admin

import (
	"cmp"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/errcode"
)

// Sentinel errors: compare with errors.Is. Each is an *inbox.Error, idem's one
// coded error type, with a stable code (inbox.Code reads it).
var (
	// ErrInvalidConfig is wrapped by the error New returns for a config it refuses
	// (code "invalid_config"), unless a more specific sentinel says what is wrong
	// (inbox.ErrInvalidSchema). Every idem package has the same value.
	ErrInvalidConfig = errcode.ErrInvalidConfig
	// ErrNotFound is returned when no inbox key or effect has that identity.
	ErrNotFound = errcode.Transient("not_found", "not found")
	// ErrNotDead is returned when the effect exists but is not dead, so there is
	// nothing to requeue.
	ErrNotDead = errcode.Transient("not_dead", "effect is not dead")
	// ErrLeaseHeld is returned when Forget found the key processing under a lease
	// that has not run out: a delivery is working on it right now.
	ErrLeaseHeld = errcode.Transient("lease_held", "a delivery holds the key's lease right now")
	// ErrBadCursor is returned when Page.After is not a cursor that this list
	// returned.
	ErrBadCursor = errcode.Permanent("bad_cursor", "bad page cursor")
	// ErrBadFilter is returned when a filter names an unknown state, or is
	// otherwise invalid.
	ErrBadFilter = errcode.Permanent("bad_filter", "bad filter")
	// ErrWrongSource is returned for an action that does not apply to the group's
	// source: retry and discard act on dead effects, release on failed inbox keys.
	ErrWrongSource = errcode.Permanent("wrong_source", "the action does not apply to this failure group")
	// ErrNoteRequired is returned for an action (not a dry run) without an audit
	// note that says who asks and why.
	ErrNoteRequired = errcode.Permanent("note_required", "a repair action needs a note: who asks, and why")
	// ErrGroupChanged is returned, and nothing was changed, when an action with
	// AtMost would change more rows than that: failures within its bound appeared
	// after the operator looked (a failure whose transaction was still committing).
	// Look again.
	ErrGroupChanged = errcode.Transient("group_changed", "the failure group holds more rows than the plan said; nothing was changed: look again")
	// ErrNotDrained is returned, and nothing was changed on either shard, when the
	// tenant is still being worked on its old shard: an inbox key processing under
	// a running lease, or an effect being sent. Drain the tenant and run it again.
	ErrNotDrained = errcode.Transient("not_drained", "the tenant is still being worked on its old shard: drain it first")
	// ErrSchemaDiffers is returned when the two shards' inbox or effects tables do
	// not have the same columns: migrate both to the same version first.
	ErrSchemaDiffers = errcode.Permanent("schema_differs", "the shards' idem tables differ: migrate both to the same version")
	// ErrShardUnavailable is wrapped by a *shardError whose shard could not be read
	// (Postgres unreachable, the connection broke): the result would miss that shard's
	// rows, so none is returned (Stats returns the others' figures too).
	ErrShardUnavailable = errcode.Transient("shard_unavailable", "a shard did not answer")

	// ErrOffRoute is returned, and nothing was changed, when an action (a requeue, a
	// forget, a failure group's retry, discard or release) would change a tenant's
	// rows on a shard that the map's route does not name for the tenant: rows that a
	// tenant move left behind or has not finished copying. Acting there too would
	// repair the same failure twice (once on each shard). Finish the move
	// (MoveTenant, run again) and switch the route to the shard that holds the rows;
	// then act again.
	ErrOffRoute = errcode.Transient("off_route", "a tenant has rows on a shard its route does not name: finish its move first")

	// ErrCitusMovesTenants is returned by MoveTenant, and nothing was changed,
	// when a database it would move from or to is Citus (its idem tables are
	// distributed): Citus places a tenant's rows itself. Move the shard that holds
	// the tenant with Citus (citus_move_shard_placement, after
	// isolate_tenant_to_new_shard for one tenant alone) or rebalance
	// (citus_rebalance_start).
	ErrCitusMovesTenants = errcode.Permanent("citus_moves_tenants", "Citus places tenants itself: move the tenant's shard with citus_move_shard_placement or rebalance with citus_rebalance_start")
)

// keyError is a sentinel with a message that names the key it is about.
type keyError struct {
	sentinel *errcode.Error
	msg      string
}

func (e *keyError) Error() string { return "idem: " + e.msg }
func (e *keyError) Unwrap() error { return e.sentinel }

// Code is the sentinel's code.
func (e *keyError) Code() string { return e.sentinel.Code() }

func errorf(sentinel *errcode.Error, format string, args ...any) error {
	return &keyError{sentinel: sentinel, msg: fmt.Sprintf(format, args...)}
}

// wrap turns a missing table into inbox.ErrSchemaMissing (which effects'
// ErrSchemaMissing callers also understand through the hint), and leaves other
// errors as they are.
func (a *part) wrap(err error) error {
	if err == nil {
		return nil
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code == "42P01" || pgErr.Code == "3F000") {
		return fmt.Errorf("%w (schema %q): %v", inbox.ErrSchemaMissing, a.cfg.Schema, err)
	}
	return err
}

// shardError is an error of one shard of the map: its message names the shard. Its code is the shard error's
// own when it has one (not_found, schema_missing...), else shard_unavailable.
type shardError struct {
	Shard string
	Err   error
}

func (e *shardError) Error() string {
	return fmt.Sprintf("idem: shard %q: %v", e.Shard, strings.TrimPrefix(e.Err.Error(), "idem: "))
}

// Unwrap gives the shard's error, and ErrShardUnavailable when that one has no
// code of its own.
func (e *shardError) Unwrap() []error {
	if errcode.Code(e.Err) != "" {
		return []error{e.Err}
	}
	return []error{ErrShardUnavailable, e.Err}
}

// Code is the code of the shard's error, else shard_unavailable.
func (e *shardError) Code() string { return cmp.Or(errcode.Code(e.Err), ErrShardUnavailable.Code()) }

// join makes one error of the parts' errors (one a part, nil for a part that did
// not fail): one database's error as it is; a shard's as a *shardError naming it,
// the shards' joined; an error that every part gives alike (a bad filter or
// cursor) as it is.
func (a *Admin) join(errs []error) error {
	return a.parts.Join(errs, alike, func(name string, err error) error { return &shardError{Shard: name, Err: err} })
}

// partErr is part i's error err as join shows it.
func (a *Admin) partErr(i int, err error) error {
	errs := make([]error, a.parts.Len())
	errs[i] = err
	return a.join(errs)
}

// alike says err is one that every part gives alike: it says nothing of a shard.
func alike(err error) bool {
	return errors.Is(err, ErrBadFilter) || errors.Is(err, ErrBadCursor) || errors.Is(err, ErrWrongSource) ||
		errors.Is(err, ErrNoteRequired) || errors.Is(err, ErrInvalidConfig)
}

// badCursor is the error of a merged cursor that a list did not return.
func badCursor(msg string) error { return &keyError{sentinel: ErrBadCursor, msg: msg} }
