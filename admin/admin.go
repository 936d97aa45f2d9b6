package admin

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/citusmode"
	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/fanout"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/promreg"
	"github.com/idemkit/idem/shard"
)

// Defaults and limits.
const (
	// DefaultStuckAfter: a pending effect due for longer than this without a claim
	// counts as stuck (no dispatcher is sending its kind, or they are far behind).
	DefaultStuckAfter = time.Minute
	// DefaultStuckAttempts: a pending effect that has failed this many times counts
	// as stuck.
	DefaultStuckAttempts = 3
	// DefaultMetricsInterval is how long the failure metrics reuse one reading of
	// the tables.
	DefaultMetricsInterval = 30 * time.Second
	// DefaultMoveRetention is how far back MoveTenant copies done effects (the
	// janitor's default retention of done effects).
	DefaultMoveRetention = 7 * 24 * time.Hour
	// DefaultLimit is a list's page size when Page.Limit is 0.
	DefaultLimit = 100
	// MaxLimit is the largest page a list returns.
	MaxLimit = 10000
	// FindLimit is the most rows of each table Find returns.
	FindLimit = 100
	// ListSamples is how many sample keys each group of a list carries.
	ListSamples = 3
	// GroupSamples is how many sample keys Group returns.
	GroupSamples = 20
	// PlanKeys is the most keys an action's result names (all of them are counted).
	PlanKeys = 100
	// MinActivityWindow and MaxActivityWindow bound Activity's window: per-minute
	// points over at most a day.
	MinActivityWindow = time.Minute
	MaxActivityWindow = 24 * time.Hour
)

// Config configures an Admin.
type Config struct {
	// Pool runs the reads and actions: a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx
	// (then every read and action is part of that transaction). Required.
	Pool inboxdb.DBTX
	// Schema of the idem tables (inbox.DefaultSchema when empty).
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
	c.Schema = fanout.Schema(c.Shards, c.Schema, inbox.DefaultSchema)
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
	if err := fanout.ValidateDB(c.Shards, c.Pool, c.Schema); err != nil {
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

// Admin runs the operator reads and actions against the idem tables of one
// database, or of every shard of a map. It is safe for concurrent use.
//
// It runs the same code over one database and over a shard map: each read and
// action runs on every database (a part each) and their answers are merged; with
// one database the answer is that database's own, cursors and errors included.
type Admin struct {
	cfg   Config
	parts *fanout.Set[*part]
}

// part runs the reads and actions on one database.
type part struct {
	db  inboxdb.DBTX
	cfg Config
	q   queries
	// name is its shard's name, "" for one database: rows read on it carry it.
	name string
	// citus knows whether the part's schema is distributed by Citus (onCitus).
	citus citusmode.Detector
}

// onCitus reports whether the part's schema is distributed by Citus
// (citusmode), asking the database the first time: the few statements Citus
// refuses have a Citus form.
func (a *part) onCitus(ctx context.Context) (bool, error) {
	on, err := a.citus.On(ctx, a.db, a.table("inbox"))
	return on, a.wrap(err)
}

// New returns an Admin that runs on cfg.Pool (or on every shard of cfg.Shards),
// or an error that wraps "invalid config".
func New(cfg Config) (*Admin, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	cfg = cfg.WithDefaults()
	parts, err := fanout.Build(cfg.Shards, cfg, cfg.forShard, newPart)
	if err != nil {
		return nil, err
	}
	for i, p := range parts.Parts() {
		p.name = parts.Name(i)
	}
	return &Admin{cfg: cfg, parts: parts}, nil
}

// newPart returns the part of the database that cfg names, its failure metrics
// registered.
func newPart(cfg Config) (*part, error) {
	p := &part{db: cfg.Pool, cfg: cfg, q: newQueries(cfg.Schema)}
	var err error
	promreg.Register(cfg.Registerer, newFailureMetrics(p), &err)
	if err != nil {
		return nil, fmt.Errorf("register metrics: %w", err)
	}
	return p, nil
}

// forShard returns c for sh's part of an Admin over a shard map: sh's database,
// and c's logger (a Forget's audit line) and registerer (the failure metrics)
// labelled with sh's name.
func (c Config) forShard(sh shard.Shard) Config {
	c.Shards, c.Pool, c.Schema = nil, sh.Pool, sh.SchemaName()
	c.Logger, c.Registerer = fanout.Label(sh, c.Logger, c.Registerer)
	return c
}

// Schema is the schema the Admin reads (with Config.Shards, the default one: each
// shard has its own).
func (a *Admin) Schema() string { return cmp.Or(a.cfg.Schema, inbox.DefaultSchema) }

// Shards are the names of the shards of Config.Shards, in map order; nil for one
// database.
func (a *Admin) Shards() []string {
	var out []string
	for _, name := range a.parts.Names() {
		if name != "" {
			out = append(out, name)
		}
	}
	return out
}
