package consumer

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/fanout"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/txmark"
	"github.com/idemkit/idem/shard"
)

// Defaults of Config, and the metadata keys the middleware writes.
const (
	// DefaultSchema holds the idem tables unless Config.Schema says otherwise.
	DefaultSchema = inbox.DefaultSchema
	// DefaultRetention is how long inbox rows live.
	DefaultRetention = inbox.DefaultRetention
	// DefaultLockTimeout bounds the wait for a concurrent delivery of one key.
	DefaultLockTimeout = 5 * time.Second
	// DefaultBusyDelay is the wait before a busy key's message is nacked.
	DefaultBusyDelay = 250 * time.Millisecond
	// DefaultLease is the lease of a key in Lease mode.
	DefaultLease = 30 * time.Second
	// DefaultMaxBatch and DefaultMaxWait bound a batch.
	DefaultMaxBatch = 32
	DefaultMaxWait  = 2 * time.Millisecond
	// DefaultWorkers is how many batches run at once.
	DefaultWorkers = 2
	// DefaultCommitTimeout bounds a COMMIT that idem has sent. The message's own
	// context never cuts a COMMIT in flight (its outcome would become unknown).
	DefaultCommitTimeout = 30 * time.Second
	// MaxErrorLen caps the error text stored with a failed key.
	MaxErrorLen = 4096

	// MetadataErrorCode is the metadata key under which the middleware leaves, on
	// a message it returns an error for (so one the router nacks, or a
	// PoisonQueue poisons), the error's stable code: inbox.Code(err), or
	// "transient" for an error without one. A broker adapter sees only the nack;
	// idem's Kafka adapter reads this key to log the code with its redelivery
	// pause (a test checks the adapter reads this very key).
	MetadataErrorCode = "idem_error_code"
	// MetadataErrorPermanent is the metadata key under which the middleware leaves
	// "true", next to MetadataErrorCode, when the error it returns is permanent
	// (IsPermanent): retrying the message cannot succeed, so nacked it holds its
	// partition (Kafka) until a PoisonQueue takes it. The Kafka adapter reads it
	// to report the partition as held.
	MetadataErrorPermanent = "idem_error_permanent"
)

// Mode is how the consumer uses transactions.
type Mode int

const (
	// Transactional (the default): one transaction per message. The inbox claim,
	// the handler's writes and its effects commit together, then the message is
	// acked.
	Transactional Mode = iota
	// GroupCommit mode: messages handled at the same moment share one transaction and
	// are acked after its one commit. The batch is set-based: one statement claims
	// all of its keys, the handlers run one after another without savepoints, one
	// statement writes all the effects they enqueued and the messages they
	// returned, and one COMMIT ends it. A failed message is isolated: the batch
	// rolls back to before its claim and runs again without it (so a handler may run
	// more than once for one delivery; its database work commits once), and when a
	// failure cannot be pinned on one message, each message runs in its own
	// savepoint. Handler code is the same as in Transactional mode, except that
	// effects.Enqueue answers Result{Deferred: true} (see effectsdb.Buffer).
	GroupCommit
	// Lease mode: the inbox row commits first as processing, with a lease and a fence,
	// for handlers that must call the outside world themselves. See docs/consumers.md
	// for what this mode cannot promise.
	Lease
)

func (m Mode) String() string {
	switch m {
	case Transactional:
		return "transactional"
	case GroupCommit:
		return "group-commit"
	case Lease:
		return "lease"
	}
	return fmt.Sprintf("Mode(%d)", int(m))
}

// KeyFunc returns a message's idempotency key.
type KeyFunc func(msg *message.Message) (string, error)

// Failure is a permanent failure, fresh or replayed, given to Config.OnFailure.
type Failure struct {
	Consumer, Tenant, Key string
	Code                  string
	Error                 string
	// Replayed: recorded by an earlier delivery; this one was acked without running.
	Replayed bool
}

// Config configures a Consumer.
type Config struct {
	// Name is the consumer, the first part of every inbox key. Default: the
	// Watermill handler name from the message context. Two handlers that share a
	// Name share their inbox.
	Name string
	// Pool runs the transactions. Required: a *pgxpool.Pool (or a *pgx.Conn, or
	// another type with Begin and BeginTx whose BeginTx honours
	// pgx.TxOptions.CommitQuery, as pgx's do: idem checks in its COMMIT that the
	// transaction it commits is still its own, see ErrTxEnded).
	Pool txmark.Beginner
	// Schema holds the idem tables (default "idem").
	Schema string
	// Shards, in place of Pool and Schema, spreads the work over several databases
	// by tenant (see package shard); Pool and Schema must then be unset, and Tenant
	// set. A message's tenant picks its shard before the claim, and the handler
	// gets a transaction on that shard. Each shard has its own group-commit and
	// batch workers (Batch.Workers a shard), so a batch holds one shard's messages. A
	// shard that is down nacks its own messages with ErrDatabaseUnavailable while
	// the others commit. A failed route returns an error wrapping shard.ErrRoute.
	Shards *shard.Map
	// SkipSchemaCheck turns off the check that New makes at start: that
	// Schema (each shard's, with Shards) holds idem's tables at the newest
	// migration this build knows. Set it only for a role that may not read
	// Postgres's catalog (New then fails with code schema_check_refused); a schema
	// that lacks a migration is then found only by the first message, which is nacked with ErrSchemaMissing.
	SkipSchemaCheck bool
	// Key gives the idempotency key (default: the message's UUID). See MetadataKey
	// and BusinessKey.
	Key KeyFunc
	// Tenant, if set, gives a tenant scope that becomes part of the inbox key, so
	// the same key from two tenants is two operations. See MetadataKey. It
	// must give a message the same tenant every time it is called: with Shards it
	// is called once to pick the shard and again to scope the message's key.
	Tenant KeyFunc
	// DefaultTenant, if set, is the tenant of a message for which Tenant gives ""
	// (it needs Tenant). With Shards and no DefaultTenant, such a message is
	// refused with ErrTenantMissing instead of being routed by the empty tenant.
	DefaultTenant string
	// Fingerprint turns the payload into the fingerprint compared on redelivery
	// (default inbox.SHA256; see inbox.CanonicalJSON).
	Fingerprint inbox.Fingerprinter
	// Retention is how long inbox rows live; it must exceed the longest time the
	// broker can redeliver (default 7 days).
	Retention time.Duration
	// LockTimeout bounds the wait for a concurrent delivery of the same key
	// (default 5 s). Past it the message is nacked with ErrBusy.
	LockTimeout time.Duration
	// BusyDelay is how long the middleware waits before nacking a message whose
	// key is busy, so that the redelivery comes after the other delivery settled
	// (default 250 ms).
	BusyDelay time.Duration
	// IsoLevel is the transaction isolation (default READ COMMITTED, which the
	// claim relies on to see a concurrent winner's row; stricter levels turn that
	// case into a serialization failure, which is nacked).
	IsoLevel pgx.TxIsoLevel
	// CommitTimeout bounds a COMMIT once idem has sent it (default 30 s). The
	// COMMIT runs under a context detached from the message's, so a cancellation
	// that comes while it is in flight does not cut it; a cancellation that comes
	// before it is sent rolls back and nacks with ErrCanceled.
	CommitTimeout time.Duration
	// PoisonOnPermanent makes a permanent failure, once recorded, return a
	// *FailedError, so that a middleware.PoisonQueue placed outside publishes the
	// message to a poison topic (and acks it). Redeliveries of a recorded failure
	// are acked, not poisoned again. Off (the default), the failure is recorded and
	// acked; redeliveries are acked too, and the failure is replayed to OnFailure
	// and the metrics.
	PoisonOnPermanent bool
	// OnFailure, if set, is called for every permanent failure, including replays.
	OnFailure func(ctx context.Context, f Failure)
	// FailExpiredRetry fails a message older than Retention permanently
	// (ErrExpiredRetry), after counting it. Off (the default), such a message is
	// counted, logged as a warning, and processed: its inbox row may already be
	// gone, so a duplicate could commit twice. The message's age comes from
	// MessageTime.
	FailExpiredRetry bool
	// MessageTime gives the broker timestamp of a message, for expired retries
	// (default: none, so no message counts as expired).
	MessageTime func(msg *message.Message) (time.Time, bool)
	// EffectKinds, if set, are the only kinds effects.Enqueue accepts in handlers.
	EffectKinds []string

	// Mode: Transactional (default), GroupCommit or Lease.
	Mode Mode
	// Batch bounds the batches of GroupCommit mode and of every HandleBatch. Lease
	// mode has no batches: Validate refuses a Batch set with Mode Lease.
	Batch BatchConfig
	// Lease is the lease of a key in Lease mode (default 30 s). Validate refuses it
	// in the other modes, which hold no lease.
	Lease time.Duration

	// Logger gets structured logs (nil: quiet). Payloads are never logged.
	Logger *slog.Logger
	// Registerer gets the Prometheus collectors (nil: not registered).
	Registerer prometheus.Registerer

	// TracerProvider makes the OpenTelemetry spans: one per message
	// ("idem.consume", with the outcome) and, under it, "idem.claim",
	// "idem.handler" and "idem.commit"; a batch of GroupCommit mode or of
	// HandleBatch gets an "idem.batch" span, linked to each of its messages' spans,
	// for its claims, its batch handler and its commit. nil means
	// otel.GetTracerProvider(): a no-op until the application calls
	// otel.SetTracerProvider, and that provider from then on.
	TracerProvider trace.TracerProvider
	// Propagator reads the trace context of a message whose context carries no span
	// from its metadata (W3C "traceparent" and "tracestate" with
	// propagation.TraceContext), to parent the message's span. nil means
	// otel.GetTextMapPropagator(): a no-op until the application calls
	// otel.SetTextMapPropagator, and that propagator from then on.
	Propagator propagation.TextMapPropagator
}

// BatchConfig bounds the batches of GroupCommit mode and of HandleBatch
// (Config.Batch). A zero field takes its default.
type BatchConfig struct {
	// MaxBatch and MaxWait bound a batch (defaults 32 and 2 ms). A batch takes the
	// messages that are in flight at once, so it is never larger than the
	// partitions (or the unacked messages) the subscriber delivers together. The
	// set-based path makes one savepoint a batch; the fallback that isolates a
	// failure it cannot pin makes one a message, and past 64 of them in one
	// transaction Postgres's per-backend subtransaction cache overflows, which
	// slows every snapshot while that transaction runs.
	MaxBatch int
	MaxWait  time.Duration
	// Workers is how many batches (of GroupCommit mode, or of each HandleBatch) run
	// at once (default 2).
	Workers int
	// PerTenant splits every batch by tenant: the messages that arrive together
	// run as one batch per tenant, one after another on the same worker, each in
	// its own transaction. Every statement of a batch then names its one tenant
	// (tenant = $n), so that a distributed Postgres that routes by tenant can run
	// each batch's transaction on one node. Off by default: a batch of one tenant
	// already uses those statements, and a mixed batch commits its tenants in one
	// transaction, which is cheaper on one database. With many tenants in flight
	// at once it makes more, smaller transactions. Without Tenant every message's
	// tenant is "", and nothing is split. On a schema distributed by Citus
	// (docs/citus.md) every batch is split, whatever this says.
	PerTenant bool
}

// WithDefaults returns c with every unset field at its default.
func (c Config) WithDefaults() Config {
	c.Schema = fanout.Schema(c.Shards, c.Schema, DefaultSchema)
	if c.Key == nil {
		c.Key = messageUUID
	}
	if c.Fingerprint == nil {
		c.Fingerprint = inbox.SHA256
	}
	c.Retention = cmp.Or(c.Retention, DefaultRetention)
	c.LockTimeout = cmp.Or(c.LockTimeout, DefaultLockTimeout)
	c.BusyDelay = cmp.Or(c.BusyDelay, DefaultBusyDelay)
	c.IsoLevel = cmp.Or(c.IsoLevel, pgx.ReadCommitted)
	c.CommitTimeout = cmp.Or(c.CommitTimeout, DefaultCommitTimeout)
	if c.Mode == Lease {
		c.Lease = cmp.Or(c.Lease, DefaultLease)
	} else {
		c.Batch.MaxBatch = cmp.Or(c.Batch.MaxBatch, DefaultMaxBatch)
		c.Batch.MaxWait = cmp.Or(c.Batch.MaxWait, DefaultMaxWait)
		c.Batch.Workers = cmp.Or(c.Batch.Workers, DefaultWorkers)
	}
	c.Logger = cmp.Or(c.Logger, slog.New(slog.DiscardHandler))
	return c
}

// Validate reports what New would refuse in c: no Pool, a bad schema or Name, a
// retention or timeout too short, an unknown Mode, a field that does nothing in
// the chosen Mode (Batch in Lease mode, Lease in the others). It checks
// c.WithDefaults(), so a config that sets only Pool passes.
func (c Config) Validate() error {
	if err := c.validateMode(); err != nil {
		return err
	}
	c = c.WithDefaults()
	if err := fanout.ValidateDB(c.Shards, c.Pool, c.Schema); err != nil {
		return err
	}
	if c.Shards != nil && c.Tenant == nil {
		return errcode.InvalidConfig("Shards routes by tenant: set Tenant")
	}
	if c.DefaultTenant != "" && c.Tenant == nil {
		return errcode.InvalidConfig("DefaultTenant needs Tenant, the function that reads a message's tenant")
	}
	if err := inboxdb.ValidateTenant(c.DefaultTenant); err != nil {
		return fmt.Errorf("DefaultTenant: %w", err)
	}
	if c.Name != "" {
		if err := inboxdb.ValidateConsumer(c.Name); err != nil {
			return err
		}
	}
	if c.Retention < time.Minute {
		return errcode.InvalidConfig("Retention %s is under a minute; it must exceed the broker's redelivery window", c.Retention)
	}
	if c.LockTimeout < time.Millisecond {
		return errcode.InvalidConfig("LockTimeout %s is under a millisecond", c.LockTimeout)
	}
	if c.CommitTimeout < time.Millisecond {
		return errcode.InvalidConfig("CommitTimeout %s is under a millisecond", c.CommitTimeout)
	}
	if c.Mode == Lease && c.Lease < 10*time.Millisecond {
		return errcode.InvalidConfig("Lease %s is under 10 ms", c.Lease)
	}
	if c.Mode != Lease && (c.Batch.MaxBatch < 1 || c.Batch.Workers < 1) {
		return errcode.InvalidConfig("Batch.MaxBatch and Batch.Workers must be at least 1")
	}
	return nil
}

// validateMode refuses an unknown Mode, and a field set that the Mode does not
// use: it would be ignored, so the config does not do what it says.
func (c Config) validateMode() error {
	switch {
	case c.Mode < Transactional || c.Mode > Lease:
		return errcode.InvalidConfig("unknown Mode %d", c.Mode)
	case c.Mode == Lease && c.Batch != BatchConfig{}:
		return errcode.InvalidConfig("Batch configures the batches of GroupCommit mode and HandleBatch; Mode is %s, which has none: unset Batch or choose another Mode", c.Mode)
	case c.Mode != Lease && c.Lease != 0:
		return errcode.InvalidConfig("Lease is the lease of Lease mode; Mode is %s, which holds no lease: unset Lease or set Mode: Lease", c.Mode)
	}
	return nil
}

// messageUUID is the default KeyFunc: the message's UUID.
func messageUUID(msg *message.Message) (string, error) { return msg.UUID, nil }

// MetadataKey returns a KeyFunc that reads a metadata field: the key (Config.Key;
// a missing field is an empty key, which fails with ErrEmptyKey: the key is never
// guessed) or the tenant (Config.Tenant).
func MetadataKey(field string) KeyFunc {
	return func(msg *message.Message) (string, error) { return msg.Metadata.Get(field), nil }
}

// BusinessKey returns a KeyFunc that derives the key from the payload, for example
// "payment:" + the decoded payment ID.
//
// An error from fn is permanent (IsPermanent reports true, so ShouldRetry does not
// retry it), but it cannot be recorded in the inbox: without a key there is no row
// to record it under. So the middleware returns it as an error that wraps
// ErrBusinessKey (code "business_key") and fn's error, whatever PoisonOnPermanent says.
// Without a middleware.PoisonQueue outside idem the message is nacked and
// redelivered forever; on Kafka it stalls its partition. Put a PoisonQueue filtered
// on IsPermanent outside idem (see the middleware order in docs/consumers.md), so a malformed
// message goes to the poison topic and is acked.
func BusinessKey(fn func(payload []byte) (string, error)) KeyFunc {
	return func(msg *message.Message) (string, error) {
		k, err := fn(msg.Payload)
		if err != nil {
			return "", fmt.Errorf("%w: %w", ErrBusinessKey, err)
		}
		return k, nil
	}
}
