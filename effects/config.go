package effects

import (
	"cmp"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/fanout"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/shard"
)

// Limits and defaults.
const (
	// DefaultBatchSize is how many effects of one kind a claim takes at most.
	DefaultBatchSize = 100
	// DefaultConcurrency is how many sends of one kind run at once.
	DefaultConcurrency = 10
	// DefaultLease is how long a claim is held before another dispatcher may take
	// the effect over. A Send gets a deadline a tenth of it earlier.
	DefaultLease = time.Minute
	// DefaultPollInterval is how often the Dispatcher looks for due effects when no
	// notification wakes it (retries coming due, a lost LISTEN connection).
	DefaultPollInterval = time.Second
	// DefaultShutdownTimeout is how long Run waits, once its context ends, for
	// sends in flight to finish before it cancels them.
	DefaultShutdownTimeout = 30 * time.Second
	// DefaultBackoffInitial is the delay after the first failure.
	DefaultBackoffInitial = time.Second
	// DefaultBackoffMax caps the delay between attempts.
	DefaultBackoffMax = time.Hour
	// DefaultBackoffMultiplier is how much the delay grows per failure.
	DefaultBackoffMultiplier = 2.0
	// DefaultPendingRefresh is how often idem_effects_pending is counted.
	DefaultPendingRefresh = 10 * time.Second
	// DefaultBackoffJitter spreads each delay by up to ±20%, so effects that failed
	// together do not all come back together.
	DefaultBackoffJitter = 0.2

	// MaxKeyLen is the longest effect key and tenant, in bytes (512).
	MaxKeyLen = effectsdb.MaxKeyLen
	// MaxPayloadLen is the largest effect payload, in bytes (8 MiB).
	MaxPayloadLen = effectsdb.MaxPayloadLen
	// DefaultMaxAttempts is how many times a sender tries an effect before it is
	// dead (25).
	DefaultMaxAttempts = effectsdb.DefaultMaxAttempts
	// DefaultSchema is the schema used when none is given.
	DefaultSchema = pgschema.Default
	// PublishKindPrefix starts the kind of an effect that publishes a Watermill
	// message: "publish:<topic>" (see PublishEffect and PublishSenders).
	PublishKindPrefix = effectsdb.PublishKindPrefix
	// TenantMetadataKey is the metadata field in which PublishSender passes on the
	// effect's tenant.
	TenantMetadataKey = "idem_tenant"
	// DefaultLedgerKeyColumn holds the effect key unless LedgerConfig says otherwise.
	DefaultLedgerKeyColumn = "effect_key"
	// DefaultLedgerPayloadColumn receives the payload unless LedgerConfig says
	// otherwise.
	DefaultLedgerPayloadColumn = "payload"
)

// Config configures a Dispatcher.
type Config struct {
	// Pool is the database. Each Dispatcher also opens one connection of its own,
	// outside the pool, to LISTEN for new effects; budget for it.
	Pool *pgxpool.Pool
	// ListenConnConfig, when set, is where that LISTEN connection goes instead of
	// the Pool's config. Behind a transaction-pooling PgBouncer, which does not
	// deliver notifications, point it at Postgres directly (or at a session pool)
	// so that new effects are sent at once rather than at the next PollInterval.
	ListenConnConfig *pgx.ConnConfig
	// Schema holds the idem tables (DefaultSchema if empty).
	Schema string
	// Shards, in place of Pool and Schema, serves several databases (see package
	// shard); Pool, Schema and ListenConnConfig must then be unset. Run runs one
	// claim loop, LISTEN connection and set of lanes a shard (Concurrency is per
	// shard), sharing the Senders. A shard that goes down holds up only its own
	// effects: its LISTEN connection reconnects with backoff while its poll goes on,
	// and it is served again once it is back, without a restart. Enqueue writes
	// through the transaction it is given: begin it on the tenant's shard
	// (shard.Map.Pick).
	Shards *shard.Map
	// SkipSchemaCheck turns off the check that NewDispatcher makes at start: that
	// Schema (each shard's, with Shards) holds idem's tables at the newest
	// migration this build knows. Set it only for a role that may not read
	// Postgres's catalog (NewDispatcher then fails with code schema_check_refused); a schema
	// that lacks a migration is then found only by Run's first claim, which fails with ErrSchemaMissing.
	SkipSchemaCheck bool
	// Senders maps each kind to its Sender. Effects of kinds without one are left
	// alone for a dispatcher that has it; they are never failed. PublishSenders
	// builds the entries for "publish:<topic>" kinds.
	Senders map[string]Sender
	// Tenant, when set, makes the Dispatcher serve that tenant's effects only:
	// its claim and its outcome writes filter on tenant = Tenant, a plain
	// equality that a distributed Postgres routing by tenant can send to one
	// node. Empty (the default): every tenant's effects, one claim for all.
	// Several Dispatchers with different Tenants may serve one database side by
	// side, and beside an unfiltered one; with Shards, every shard's Dispatcher
	// filters on it. The claim walks the due effects of a kind in due order past
	// other tenants' ones, so on a database shared by many tenants a filtered
	// Dispatcher costs more per claim than an unfiltered one. Its
	// idem_effects_pending gauge still counts every tenant's effects: the gauge
	// has no tenant label, and Dispatchers on one registry share its series.
	Tenant string
	// BatchSize caps how many effects of one kind one claim takes
	// (DefaultBatchSize).
	BatchSize int
	// Concurrency is the number of sends of each kind that run at once, by kind;
	// a kind not in the map gets DefaultConcurrency. The Dispatcher holds at most
	// Concurrency + min(Concurrency, BatchSize) claims of a kind: the ones being sent
	// and one round waiting, each until its outcome is recorded. So one claim takes
	// at most min(BatchSize, that bound); for a fast sender, raise both, with
	// Concurrency about twice BatchSize (see docs/effects.md).
	Concurrency map[string]int
	// Lease is how long a claim lasts (DefaultLease). A Send's context ends a tenth
	// of the lease before the lease does.
	Lease time.Duration
	// Backoff spaces retries after transient failures.
	Backoff Backoff
	// MaxAttempts, when above 0, caps every effect's attempts on top of the
	// max_attempts it was enqueued with (DefaultMaxAttempts unless Effect.MaxAttempts
	// said otherwise). 0 leaves each effect's own limit.
	MaxAttempts int
	// PollInterval is how often to look for due effects without a notification
	// (DefaultPollInterval).
	PollInterval time.Duration
	// ShutdownTimeout bounds the wait for sends in flight when Run's context ends
	// (DefaultShutdownTimeout). Past it their contexts are cancelled.
	ShutdownTimeout time.Duration
	// Logger receives the Dispatcher's logs; nil is quiet. Payloads are never
	// logged.
	Logger *slog.Logger
	// Registerer receives the Prometheus metrics; nil registers none. Several
	// Dispatchers may share one registry. Every series of the Senders' kinds exists
	// from NewDispatcher on, at 0.
	Registerer prometheus.Registerer
	// PendingRefresh is how often idem_effects_pending is counted
	// (DefaultPendingRefresh), with one count(*) … GROUP BY kind over the pending
	// rows. Only with a Registerer.
	PendingRefresh time.Duration

	// TracerProvider makes the OpenTelemetry span of each send ("idem.send"), a new
	// trace's root that links to the trace context the effect row kept from its
	// Enqueue. nil means otel.GetTracerProvider(): a no-op until the application
	// calls otel.SetTracerProvider, and that provider from then on.
	TracerProvider trace.TracerProvider
	// Propagator is how PublishSender writes the send's trace context into the
	// metadata of the message it publishes, for the next consumer to continue the
	// trace. nil means otel.GetTextMapPropagator(): a no-op until the application
	// calls otel.SetTextMapPropagator, and that propagator from then on.
	Propagator propagation.TextMapPropagator
}

// Backoff is exponential backoff with jitter: the n-th failure waits
// min(Max, Initial·Multiplier^(n-1)), spread by ±Jitter.
type Backoff struct {
	Initial    time.Duration // DefaultBackoffInitial
	Max        time.Duration // DefaultBackoffMax
	Multiplier float64       // DefaultBackoffMultiplier
	Jitter     float64       // DefaultBackoffJitter; in [0, 1]
}

// WithDefaults returns b with every unset field at its default. Jitter 0 means the
// default; a negative Jitter means none.
func (b Backoff) WithDefaults() Backoff {
	b.Initial = cmp.Or(b.Initial, DefaultBackoffInitial)
	b.Max = cmp.Or(b.Max, DefaultBackoffMax)
	b.Multiplier = cmp.Or(b.Multiplier, DefaultBackoffMultiplier)
	switch {
	case b.Jitter == 0:
		b.Jitter = DefaultBackoffJitter
	case b.Jitter < 0:
		b.Jitter = 0
	}
	return b
}

// Validate reports what a Dispatcher would refuse in b. It checks
// b.WithDefaults(), so the zero Backoff passes.
func (b Backoff) Validate() error {
	b = b.WithDefaults()
	switch {
	case b.Initial <= 0:
		return errcode.InvalidConfig("backoff initial must be positive")
	case b.Max < b.Initial:
		return errcode.InvalidConfig("backoff max must be at least initial")
	case b.Multiplier < 1:
		return errcode.InvalidConfig("backoff multiplier must be at least 1")
	case b.Jitter < 0 || b.Jitter > 1:
		return errcode.InvalidConfig("backoff jitter must be in [0, 1]")
	}
	return nil
}

// Delay is the wait after the failure of attempt n (counting from 1).
func (b Backoff) Delay(n int) time.Duration {
	d := float64(b.Initial) * math.Pow(b.Multiplier, float64(max(n-1, 0)))
	d = min(d, float64(b.Max))
	if b.Jitter > 0 {
		d *= 1 + b.Jitter*(2*rand.Float64()-1)
	}
	return time.Duration(min(d, float64(b.Max)))
}

// WithDefaults returns c with every unset field at its default.
func (c Config) WithDefaults() Config {
	c.Schema = fanout.Schema(c.Shards, c.Schema, DefaultSchema)
	c.BatchSize = cmp.Or(c.BatchSize, DefaultBatchSize)
	c.Lease = cmp.Or(c.Lease, DefaultLease)
	c.Backoff = c.Backoff.WithDefaults()
	c.PollInterval = cmp.Or(c.PollInterval, DefaultPollInterval)
	c.ShutdownTimeout = cmp.Or(c.ShutdownTimeout, DefaultShutdownTimeout)
	c.PendingRefresh = cmp.Or(c.PendingRefresh, DefaultPendingRefresh)
	c.Logger = cmp.Or(c.Logger, slog.New(slog.DiscardHandler))
	return c
}

// Validate reports what NewDispatcher would refuse in c: no Pool or Senders, a bad
// schema, kind or Tenant (ErrInvalidTenant), a non-positive size or interval, a bad Backoff. It checks
// c.WithDefaults(), so a config with a Pool and Senders passes.
func (c Config) Validate() error {
	c = c.WithDefaults()
	if err := fanout.ValidateDB(c.Shards, c.Pool, c.Schema); err != nil {
		return err
	}
	if c.Shards != nil && c.ListenConnConfig != nil {
		return errcode.InvalidConfig("ListenConnConfig names one database; with Shards each shard's LISTEN uses its pool's config")
	}
	if len(c.Senders) == 0 {
		return errcode.InvalidConfig("no Senders registered")
	}
	for kind, s := range c.Senders {
		if !effectsdb.ValidKind(kind) {
			return fmt.Errorf("sender for %q: %w", kind, ErrInvalidKind)
		}
		if s == nil {
			return errcode.InvalidConfig("sender for %q is nil", kind)
		}
	}
	for kind, n := range c.Concurrency {
		if _, ok := c.Senders[kind]; !ok {
			return errcode.InvalidConfig("concurrency for %q, which has no sender", kind)
		}
		if n <= 0 {
			return errcode.InvalidConfig("concurrency for %q must be positive, got %d", kind, n)
		}
	}
	if err := effectsdb.ValidateTenant(c.Tenant); err != nil {
		return fmt.Errorf("tenant: %w", err)
	}
	if c.BatchSize <= 0 {
		return errcode.InvalidConfig("batch size must be positive, got %d", c.BatchSize)
	}
	if c.Lease < 10*time.Millisecond {
		return errcode.InvalidConfig("lease must be at least 10ms, got %s", c.Lease)
	}
	if c.MaxAttempts < 0 {
		return errcode.InvalidConfig("max attempts must not be negative, got %d", c.MaxAttempts)
	}
	if c.PollInterval <= 0 {
		return errcode.InvalidConfig("poll interval must be positive, got %s", c.PollInterval)
	}
	if c.PendingRefresh <= 0 {
		return errcode.InvalidConfig("pending refresh must be positive, got %s", c.PendingRefresh)
	}
	if c.ShutdownTimeout <= 0 {
		return errcode.InvalidConfig("shutdown timeout must be positive, got %s", c.ShutdownTimeout)
	}
	if err := c.Backoff.Validate(); err != nil {
		return err
	}
	return nil
}
