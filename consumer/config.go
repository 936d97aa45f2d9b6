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
	"github.com/idemkit/idem/shard"
)

// Defaults of Config.
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
	// effects.Enqueue answers Result{Deferred: true} (see effects.Buffer).
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

// PermanentPolicy says what happens to a message whose handling failed permanently,
// after the failure is recorded in the inbox.
type PermanentPolicy int

const (
	// AckOnPermanent (the default): record the failure and ack. Redeliveries are
	// acked too, and the failure is replayed to OnFailure and the metrics.
	AckOnPermanent PermanentPolicy = iota
	// PoisonOnPermanent records the failure and returns a *FailedError, so that a
	// middleware.PoisonQueue placed outside publishes the message to a poison topic
	// (and acks it). Redeliveries of a recorded failure are acked, not poisoned
	// again.
	PoisonOnPermanent
)

// ExpiredRetryPolicy says what happens to a message older than the retention.
type ExpiredRetryPolicy int

const (
	// ExpiredRetryWarn (the default): count it, log a warning, and process it. Its
	// inbox row may already be gone, so a duplicate could commit twice.
	ExpiredRetryWarn ExpiredRetryPolicy = iota
	// ExpiredRetryFail counts it and fails it permanently (ErrExpiredRetry).
	ExpiredRetryFail
)

// KeyFunc returns a message's idempotency key.
type KeyFunc func(msg *message.Message) (string, error)

// Beginner starts a transaction; *pgxpool.Pool and *pgx.Conn do. BeginTx must honour
// pgx.TxOptions.CommitQuery, as pgx's own implementations do: idem marks every
// transaction it begins and checks the mark in its COMMIT, to know that the
// transaction it commits is still its own (see ErrTxEnded).
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
}

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
	// Pool runs the transactions. Required.
	Pool Beginner
	// Schema holds the idem tables (default "idem").
	Schema string
	// Shards, in place of Pool and Schema, spreads the work over several databases
	// by tenant (see package shard); Pool and Schema must then be unset, and Tenant
	// set. A message's tenant picks its shard before the claim, and the handler
	// gets a transaction on that shard. Each shard has its own group-commit and
	// batch workers (Workers a shard), so a batch holds one shard's messages. A
	// shard that is down nacks its own messages with ErrDatabaseUnavailable while
	// the others commit. A failed route returns an error wrapping shard.ErrRoute.
	Shards *shard.Map
	// Key gives the idempotency key (default: the message UUID). See MetadataKey
	// and BusinessKey.
	Key KeyFunc
	// Tenant, if set, gives a tenant scope that becomes part of the inbox key, so
	// the same key from two tenants is two operations. See MetadataTenant. It
	// must give a message the same tenant every time it is called: with Shards it
	// is called once to pick the shard and again by that shard's consumer.
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
	// OnPermanent chooses what a permanent failure does after it is recorded.
	OnPermanent PermanentPolicy
	// OnFailure, if set, is called for every permanent failure, including replays.
	OnFailure func(ctx context.Context, f Failure)
	// ExpiredRetry chooses what a message older than Retention does. The message's
	// age comes from MessageTime.
	ExpiredRetry ExpiredRetryPolicy
	// MessageTime gives the broker timestamp of a message, for expired retries
	// (default: none, so no message counts as expired).
	MessageTime func(msg *message.Message) (time.Time, bool)
	// EffectKinds, if set, are the only kinds effects.Enqueue accepts in handlers.
	EffectKinds []string

	// Mode: Transactional (default), GroupCommit or Lease.
	Mode Mode
	// MaxBatch and MaxWait bound a batch, of GroupCommit mode or of HandleBatch
	// (defaults 32 and 2 ms). A batch takes the messages that are in flight at
	// once, so it is never larger than the partitions (or the unacked messages) the
	// subscriber delivers together. The set-based path makes one savepoint a batch;
	// the fallback that isolates a failure it cannot pin makes one a message, and
	// past 64 of them in one transaction Postgres's per-backend subtransaction cache
	// overflows, which slows every snapshot while that transaction runs.
	MaxBatch int
	MaxWait  time.Duration
	// Workers is how many batches (of GroupCommit mode, or of each HandleBatch) run
	// at once (default 2).
	Workers int
	// BatchPerTenant splits every batch (of GroupCommit mode, or of HandleBatch)
	// by tenant: the messages that arrive together run as one batch per tenant, one
	// after another on the same worker, each in its own transaction. Every
	// statement of a batch then names its one tenant (tenant = $n), so that a
	// distributed Postgres that routes by tenant can run each batch's transaction
	// on one node. Off by default: a batch of one tenant already uses those
	// statements, and a mixed batch commits its tenants in one transaction, which
	// is cheaper on one database. With many tenants in flight at once it makes
	// more, smaller transactions. Without Tenant every message's tenant is "", and
	// nothing is split. On a schema distributed by Citus (docs/citus.md) every
	// batch is split, whatever this says.
	BatchPerTenant bool
	// Lease is the lease length in Lease mode (default 30 s).
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

// WithDefaults returns c with every unset field at its default.
func (c Config) WithDefaults() Config {
	if c.Shards == nil {
		c.Schema = cmp.Or(c.Schema, DefaultSchema)
	}
	if c.Key == nil {
		c.Key = MessageUUID
	}
	if c.Fingerprint == nil {
		c.Fingerprint = inbox.SHA256
	}
	c.Retention = cmp.Or(c.Retention, DefaultRetention)
	c.LockTimeout = cmp.Or(c.LockTimeout, DefaultLockTimeout)
	c.BusyDelay = cmp.Or(c.BusyDelay, DefaultBusyDelay)
	c.IsoLevel = cmp.Or(c.IsoLevel, pgx.ReadCommitted)
	c.CommitTimeout = cmp.Or(c.CommitTimeout, DefaultCommitTimeout)
	c.MaxBatch = cmp.Or(c.MaxBatch, DefaultMaxBatch)
	c.MaxWait = cmp.Or(c.MaxWait, DefaultMaxWait)
	c.Workers = cmp.Or(c.Workers, DefaultWorkers)
	c.Lease = cmp.Or(c.Lease, DefaultLease)
	c.Logger = cmp.Or(c.Logger, slog.New(slog.DiscardHandler))
	return c
}

// Validate reports what New would refuse in c: no Pool, a bad schema or Name, a
// retention or timeout too short, an unknown Mode. It checks c.WithDefaults(), so a
// config that sets only Pool passes.
func (c Config) Validate() error {
	c = c.WithDefaults()
	if err := shard.ValidateDB(c.Shards, c.Pool, c.Schema); err != nil {
		return err
	}
	if c.Shards != nil && c.Tenant == nil {
		return errcode.InvalidConfig("Shards routes by tenant: set Tenant")
	}
	if c.DefaultTenant != "" && c.Tenant == nil {
		return errcode.InvalidConfig("DefaultTenant needs Tenant, the function that reads a message's tenant")
	}
	if err := inbox.ValidateTenant(c.DefaultTenant); err != nil {
		return fmt.Errorf("DefaultTenant: %w", err)
	}
	if c.Name != "" {
		if err := inbox.ValidateConsumer(c.Name); err != nil {
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
	if c.Lease < 10*time.Millisecond {
		return errcode.InvalidConfig("Lease %s is under 10 ms", c.Lease)
	}
	if c.Mode < Transactional || c.Mode > Lease {
		return errcode.InvalidConfig("unknown Mode %d", c.Mode)
	}
	if c.MaxBatch < 1 || c.Workers < 1 {
		return errcode.InvalidConfig("MaxBatch and Workers must be at least 1")
	}
	return nil
}

// MessageUUID is the default KeyFunc: the message's UUID.
func MessageUUID(msg *message.Message) (string, error) { return msg.UUID, nil }

// MetadataKey returns a KeyFunc that reads the key from a metadata field. A missing
// field is an empty key, which fails with ErrEmptyKey: the key is never guessed.
func MetadataKey(field string) KeyFunc {
	return func(msg *message.Message) (string, error) { return msg.Metadata.Get(field), nil }
}

// BusinessKey returns a KeyFunc that derives the key from the payload, for example
// "payment:" + the decoded payment ID.
//
// An error from fn is permanent (IsPermanent reports true, so ShouldRetry does not
// retry it), but it cannot be recorded in the inbox: without a key there is no row
// to record it under. So the middleware returns it as an error that wraps
// ErrBusinessKey (code "business_key") and fn's error, whatever OnPermanent says.
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

// MetadataTenant returns a Tenant func that reads the tenant from a metadata field.
func MetadataTenant(field string) KeyFunc { return MetadataKey(field) }
