package admin

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/promreg"
	"github.com/idemkit/idem/shard"
)

// DB is what the API runs its statements on: a *pgxpool.Pool, a *pgx.Conn or a
// pgx.Tx (then every read and action is part of that transaction). It is
// inboxdb.DBTX.
type DB = inboxdb.DBTX

// Defaults of Config.
const (
	// DefaultSchema holds the idem tables unless Config.Schema says otherwise.
	DefaultSchema = inbox.DefaultSchema
	// DefaultStuckAfter: a pending effect due for longer than this without a claim
	// counts as stuck (no dispatcher is sending its kind, or they are far behind).
	DefaultStuckAfter = time.Minute
	// DefaultStuckAttempts: a pending effect that has failed this many times counts
	// as stuck.
	DefaultStuckAttempts = 3
	// DefaultLimit is a list's page size when Page.Limit is 0.
	DefaultLimit = 100
	// MaxLimit is the largest page a list returns.
	MaxLimit = 10000
)

// Config configures an Admin.
type Config struct {
	// Pool runs the reads and actions: a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx
	// (then every read and action is part of that transaction). Required.
	Pool DB
	// Schema of the idem tables (DefaultSchema when empty).
	Schema string
	// Logger receives the audit line of every Forget, at warn level (nil: a quiet
	// logger, which a caller that forgets keys should not want). With Shards, the
	// line names the shard (attribute shard).
	Logger *slog.Logger
	// StuckAfter and StuckAttempts say when a pending effect counts as stuck
	// (DefaultStuckAfter, DefaultStuckAttempts when 0).
	StuckAfter    time.Duration
	StuckAttempts int
	// Registerer gets the failure metrics (nil: none): idem_inbox_failed_keys by
	// consumer, idem_effects_dead_rows by kind and idem_failures_repaired_total by
	// action, read from the tables when scraped. Register them in one process per
	// schema (the one that runs the janitor, say): every process would report the
	// same numbers. With Shards, each shard's series carry its name (label shard).
	Registerer prometheus.Registerer
	// Consumers and Kinds are reported by the failure metrics at 0 before anything
	// failed, so that a dashboard has its series from the start.
	Consumers, Kinds []string
	// MetricsInterval is how long the failure metrics reuse one reading of the
	// tables (DefaultMetricsInterval when 0).
	MetricsInterval time.Duration
	// Shards, in place of Pool and Schema, makes the Admin read and act on every
	// shard of the map: lists merge the shards' rows in key order with a cursor
	// that carries each shard's position, and every row names its shard. A shard
	// that does not answer is an error naming it (see ErrShardUnavailable).
	Shards *shard.Map
}

// WithDefaults returns c with every unset field at its default.
func (c Config) WithDefaults() Config {
	if c.Shards == nil {
		c.Schema = cmp.Or(c.Schema, DefaultSchema)
	}
	c.StuckAfter = cmp.Or(c.StuckAfter, DefaultStuckAfter)
	c.StuckAttempts = cmp.Or(c.StuckAttempts, DefaultStuckAttempts)
	c.MetricsInterval = cmp.Or(c.MetricsInterval, DefaultMetricsInterval)
	c.Logger = cmp.Or(c.Logger, slog.New(slog.DiscardHandler))
	return c
}

// Validate reports what New would refuse in c: no Pool, a bad schema, a negative
// stuck threshold. It checks c.WithDefaults(), so a config with a Pool passes.
func (c Config) Validate() error {
	c = c.WithDefaults()
	if err := shard.ValidateDB(c.Shards, c.Pool, c.Schema); err != nil {
		return err
	}
	if c.StuckAfter < 0 || c.StuckAttempts < 0 {
		return errcode.InvalidConfig("StuckAfter and StuckAttempts must not be negative")
	}
	if c.MetricsInterval < 0 {
		return errcode.InvalidConfig("MetricsInterval must not be negative")
	}
	return nil
}

// Admin runs the operator reads and actions against the idem tables of one schema.
// It is safe for concurrent use.
type Admin struct {
	db  DB
	cfg Config
	q   queries
	// shards are the Admins of each shard of Config.Shards (nil for one
	// database); name is a shard Admin's shard.
	shards []*Admin
	name   string
}

// New returns an Admin that runs on cfg.Pool, or an error that wraps "invalid
// config".
func New(cfg Config) (*Admin, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	cfg = cfg.WithDefaults()
	if cfg.Shards != nil {
		parts, err := shard.Each(cfg.Shards, cfg.forShard, New)
		if err != nil {
			return nil, err
		}
		for i, part := range parts {
			part.name = cfg.Shards.Shards[i].Name
		}
		return &Admin{cfg: cfg, shards: parts}, nil
	}
	a := newAdmin(cfg)
	var err error
	promreg.Register(cfg.Registerer, newFailureMetrics(a), &err)
	if err != nil {
		return nil, fmt.Errorf("register metrics: %w", err)
	}
	return a, nil
}

// forShard returns c for sh's part of an Admin over a shard map: sh's database,
// and c's logger (a Forget's audit line) and registerer (the failure metrics)
// labelled with sh's name.
func (c Config) forShard(sh shard.Shard) Config {
	c.Shards, c.Pool, c.Schema = nil, sh.Pool, sh.SchemaName()
	c.Logger, c.Registerer = sh.Label(c.Logger, c.Registerer)
	return c
}

func newAdmin(cfg Config) *Admin {
	return &Admin{db: cfg.Pool, cfg: cfg, q: newQueries(cfg.Schema)}
}

// Schema is the schema the Admin reads (with Config.Shards, the default one: each
// shard has its own).
func (a *Admin) Schema() string { return cmp.Or(a.cfg.Schema, DefaultSchema) }

// Error is an idem error with a stable code, such as "not_dead"; compare with
// errors.Is against the sentinels. It is the one coded error type of every idem
// package (inbox.Error is the same type).
type Error = errcode.Error

// Sentinel errors.
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
)

// keyError is a sentinel with a message that names the key it is about.
type keyError struct {
	sentinel *Error
	msg      string
}

func (e *keyError) Error() string { return "idem: " + e.msg }
func (e *keyError) Unwrap() error { return e.sentinel }

// Code is the sentinel's code.
func (e *keyError) Code() string { return e.sentinel.Code() }

func errorf(sentinel *Error, format string, args ...any) error {
	return &keyError{sentinel: sentinel, msg: fmt.Sprintf(format, args...)}
}

// wrap turns a missing table into inbox.ErrSchemaMissing (which effects'
// ErrSchemaMissing callers also understand through the hint), and leaves other
// errors as they are.
func (a *Admin) wrap(err error) error {
	if err == nil {
		return nil
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code == "42P01" || pgErr.Code == "3F000") {
		return fmt.Errorf("%w (schema %q): %v", inbox.ErrSchemaMissing, a.cfg.Schema, err)
	}
	return err
}

// Requeue brings one dead effect, named by its whole identity, back to pending
// (effectsdb.RequeueDead): attempts start again from 0, it is due now, and
// dispatchers are notified. An effect that is not dead is ErrNotDead, one that does
// not exist ErrNotFound; either way nothing changed.
func (a *Admin) Requeue(ctx context.Context, id EffectID) error {
	if a.shards != nil {
		return a.shardedRequeue(ctx, id)
	}
	n, err := effectsdb.RequeueDead(ctx, a.db, a.cfg.Schema, effectsdb.RequeueFilter{
		Tenant: id.Tenant, TenantExact: true, Kind: id.Kind, Key: id.Key,
	})
	if err != nil {
		return a.wrap(err)
	}
	if n > 0 {
		return nil
	}
	e, err := a.InspectEffect(ctx, id)
	if err != nil {
		return err
	}
	return errorf(ErrNotDead, "effect %s is %s, not dead: nothing to requeue", id, e.State)
}

// RequeueDead brings every dead effect that f picks back to pending and returns how
// many; see effectsdb.RequeueDead for the filter's rules.
func (a *Admin) RequeueDead(ctx context.Context, f effectsdb.RequeueFilter) (int64, error) {
	if a.shards != nil {
		return a.shardedRequeueDead(ctx, f)
	}
	n, err := effectsdb.RequeueDead(ctx, a.db, a.cfg.Schema, f)
	return n, a.wrap(err)
}

// Audit says who forgets a key and why, for the log line.
type Audit struct {
	// Who asked: a user name, a ticket's author (empty: "unknown").
	Who string
	// Why: a reason, a ticket reference.
	Why string
}

// Forget deletes one inbox key and returns the row it deleted.
//
// It is dangerous: the next delivery of that key, or a retry of that HTTP request,
// runs its handler again, so the business work may commit a second time. Use it for
// a key recorded as failed whose cause is now fixed, or one whose command must run
// again on purpose. Effects the first run made stay as they are and keep their keys,
// so a re-run that enqueues the same effects enqueues nothing new.
//
// A key that a delivery holds under a running lease (lease mode) is refused with
// ErrLeaseHeld; a missing one is ErrNotFound. Every forget is logged at warn level
// with the key, its state and fingerprint, who and why.
func (a *Admin) Forget(ctx context.Context, id inbox.ID, audit Audit) (*InboxKey, error) {
	if a.shards != nil {
		return a.shardedForget(ctx, id, audit)
	}
	if err := id.Validate(); err != nil {
		return nil, err
	}
	var k *InboxKey
	k, err := scanInboxKey(a.db.QueryRow(ctx, a.q.forget, id.Consumer, id.Tenant, id.Key))
	err = a.wrap(err)
	if errors.Is(err, pgx.ErrNoRows) {
		var state string
		var lease *time.Time
		err := a.db.QueryRow(ctx, a.q.inboxState, id.Consumer, id.Tenant, id.Key).Scan(&state, &lease)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			return nil, errorf(ErrNotFound, "no inbox key %s", formatID(id))
		case err != nil:
			return nil, a.wrap(err)
		}
		until := ""
		if lease != nil {
			until = " until " + lease.UTC().Format(time.RFC3339)
		}
		return nil, errorf(ErrLeaseHeld, "inbox key %s is %s under a delivery's lease%s: nothing was deleted; try again after the lease", formatID(id), state, until)
	}
	if err != nil {
		return nil, err
	}
	a.cfg.Logger.LogAttrs(ctx, slog.LevelWarn, "idem: inbox key forgotten; its next delivery runs the handler again",
		slog.String("schema", a.cfg.Schema),
		slog.String("consumer", k.Consumer), slog.String("tenant", k.Tenant), slog.String("key", k.Key),
		slog.String("state", k.State), slog.String("fingerprint", k.Fingerprint.String()),
		slog.Time("received_at", k.ReceivedAt),
		slog.String("who", cmp.Or(audit.Who, "unknown")), slog.String("why", audit.Why))
	return k, nil
}

func formatID(id inbox.ID) string {
	if id.Tenant == "" {
		return fmt.Sprintf("consumer %q key %q", id.Consumer, id.Key)
	}
	return fmt.Sprintf("consumer %q tenant %q key %q", id.Consumer, id.Tenant, id.Key)
}
