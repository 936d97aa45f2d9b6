package consumer

import (
	"cmp"
	"context"
	"crypto/sha256"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/citusmode"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/tracing"
	"github.com/idemkit/idem/internal/txmark"
)

// engine is the Consumer's single-database part: it claims, runs and settles the
// messages of one database, in transactions on it, with its own metrics and
// group-commit and batch workers. It is safe for concurrent use.
type engine struct {
	cfg        Config
	store      *inboxdb.Store
	batchStore *batchStore
	metrics    *metrics
	log        *slog.Logger
	tracer     trace.Tracer
	prop       propagation.TextMapPropagator

	// prelude goes ahead of the first claim of a transaction, in its round trip.
	prelude []string
	// setPrelude goes ahead of a set-based batch's first claim: prelude, the commit
	// guard, and the savepoint that later rounds of the batch roll back to.
	setPrelude []string

	// seen holds the consumer names whose metric series exist (Name unset).
	seen sync.Map
	// defaultFP: the fingerprint is the default, the payload's SHA-256, which
	// prepare writes into the request itself (no allocation).
	defaultFP bool

	mu       sync.Mutex
	closed   bool
	inflight sync.WaitGroup
	group    *groupCommitter   // the Middleware's, in GroupCommit mode, started by its first message
	batches  []*groupCommitter // every committer started: group, and one per HandleBatch
	stop     sync.Once
	// orderOnce logs the first message refused for a PoisonQueue inside idem.
	orderOnce sync.Once

	// requireTenant: this engine is one shard's part of a shard map, so a message
	// without a tenant is refused (ErrTenantMissing), never routed by the empty
	// tenant.
	requireTenant bool

	// citus: whether the schema is distributed by Citus, asked once (txOptions).
	citus citusmode.Detector
}

// newEngine returns the engine of one database; pc.Config has its defaults, is
// valid, and names that database (Pool and Schema).
func newEngine(pc partConfig) (*engine, error) {
	cfg := pc.Config
	store, err := inboxdb.NewStore(cfg.Schema)
	if err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, fmt.Errorf("register metrics: %w", err)
	}
	c := &engine{cfg: cfg, store: store, batchStore: newBatchStore(cfg.Schema), metrics: m, log: cfg.Logger,
		tracer: tracing.Tracer(cfg.TracerProvider), prop: tracing.Propagator(cfg.Propagator),
		prelude: []string{
			// SET LOCAL takes no bind parameters; the value is an integer we format.
			"SET LOCAL lock_timeout = " + strconv.FormatInt(max(cfg.LockTimeout.Milliseconds(), 1), 10),
			txmark.Mark,
		},
	}
	c.defaultFP, c.requireTenant = pc.defaultFP, pc.requireTenant
	c.setPrelude = append(slices.Clone(c.prelude), guardSQL(cfg.Schema), "SAVEPOINT idem_batch")
	if cfg.Name != "" {
		m.init(cfg.Name)
		c.seen.Store(cfg.Name, struct{}{})
	}
	return c, nil
}

// close refuses new messages, waits for those in progress, and stops the
// group-commit and batch workers (see Consumer.Close).
func (c *engine) close() error {
	c.stop.Do(func() {
		c.mu.Lock()
		c.closed = true
		groups := slices.Clone(c.batches)
		c.mu.Unlock()
		// No delivery enters after closed is set, so Wait cannot race an Add.
		c.inflight.Wait()
		for _, g := range groups {
			g.close()
		}
	})
	return nil
}

// middleware is the handler of h on this engine. In GroupCommit mode every
// Middleware handler of the engine shares one committer (c.group), each message
// carrying its own handler.
func (c *engine) middleware(h message.HandlerFunc) message.HandlerFunc {
	var slot **groupCommitter
	if c.cfg.Mode == GroupCommit {
		slot = &c.group
	}
	return func(msg *message.Message) ([]*message.Message, error) {
		return nil, c.handle(msg, h, slot, nil)
	}
}

// handleBatch is the handler of h on this engine: a message joins a batch of
// this handler's committer, and is answered once the batch has settled.
func (c *engine) handleBatch(h BatchHandler) message.NoPublishHandlerFunc {
	var committer *groupCommitter
	return func(msg *message.Message) error {
		return c.handle(msg, nil, &committer, h)
	}
}

// handle is one message's flow through the engine, in every mode: read its key,
// tenant and fingerprint (prepare), admit it (enter), claim its key, run its
// handler and settle the outcome in the inbox (process), and answer it: ack, nack
// or poison (finish). slot, if not nil, holds the committer of the batches the
// message joins (GroupCommit mode, HandleBatch), started by the first message;
// batch is HandleBatch's handler, h the message handler of the other cases.
func (c *engine) handle(msg *message.Message, h message.HandlerFunc, slot **groupCommitter, batch BatchHandler) error {
	req, err := c.prepare(msg)
	if err != nil {
		return err
	}
	defer endPanicked(req)
	group, ok := c.enter(slot, batch)
	if !ok {
		return c.finish(req, outcome{kind: outTransient, err: ErrClosed})
	}
	defer c.inflight.Done()
	return c.finish(req, c.process(req, group, h))
}

// enter admits one delivery, starting the committer in *slot (if slot is not nil)
// on first use. It reports false after Close. Every admitted delivery calls
// c.inflight.Done.
func (c *engine) enter(slot **groupCommitter, batch BatchHandler) (*groupCommitter, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, false
	}
	c.inflight.Add(1)
	if slot == nil {
		return nil, true
	}
	if *slot == nil {
		*slot = newGroupCommitter(c, batch)
		c.batches = append(c.batches, *slot)
	}
	return *slot, true
}

// process claims req's key, runs its handler and settles the outcome in the
// inbox: in a batch of group's, in a lease, or in a transaction of its own. A
// message found invalid before any claim only has its failure recorded.
func (c *engine) process(req *request, group *groupCommitter, h message.HandlerFunc) outcome {
	switch {
	case req.invalid != nil:
		return c.recordFailure(req, req.invalid)
	case group != nil:
		return group.submit(req, h)
	case c.cfg.Mode == Lease:
		return c.handleLease(req, h)
	default:
		return c.handleOne(req, h)
	}
}

// request is one delivery on its way through the inbox.
type request struct {
	msg *message.Message
	// ctx is the message's context with its idem.consume span.
	ctx context.Context
	// msgCtx is the message's own context, given back to it after the handler.
	msgCtx   context.Context
	span     trace.Span
	spanDone bool
	claim    inboxdb.Claim
	// invalid: a permanent error found before any claim (bad key, bad payload).
	invalid error
	// recordable: invalid, but the key is good, so the failure can be recorded.
	recordable bool
	// expiredCounted: this delivery is counted in idem_inbox_expired_retry_total
	// already (its message is older than the retention, or a claim of it forgot an
	// expired row), so it is not counted again.
	expiredCounted bool
	// sum holds claim.Fingerprint with the default fingerprint.
	sum [sha256.Size]byte
}

// noteExpired counts a delivery whose claim forgot its key's expired row, once per
// delivery however many claims of it (group-commit rounds) meet the row.
func (c *engine) noteExpired(req *request, res inboxdb.ClaimResult) {
	if !res.Expired || req.expiredCounted {
		return
	}
	req.expiredCounted = true
	c.metrics.expiredRetry.WithLabelValues(req.claim.Consumer).Inc()
	c.log.Info("idem: the key's inbox row was past its retention; the message runs as new", req.attrs()...)
}

func (r *request) attrs() []any {
	return []any{"consumer", r.claim.Consumer, "tenant", r.claim.Tenant, "key", r.claim.Key}
}

// prepare computes the key, tenant and fingerprint. A returned error is not about
// the message (no consumer name); an invalid message is flagged in req.invalid.
func (c *engine) prepare(msg *message.Message) (*request, error) {
	ctx := msg.Context()
	name := c.cfg.Name
	if name == "" {
		name = message.HandlerNameFromCtx(ctx)
	}
	if name == "" {
		return nil, ErrNoName
	}
	if c.cfg.Name == "" {
		if _, seen := c.seen.LoadOrStore(name, struct{}{}); !seen {
			c.metrics.init(name)
		}
	}
	req := &request{msg: msg, msgCtx: ctx}
	req.ctx, req.span = c.startMessage(msg, name)
	req.claim.Consumer = name
	req.claim.Retention = c.cfg.Retention

	key, err := c.cfg.Key(msg)
	switch {
	case err != nil:
	case key == "":
		err = errNoKey
	default:
		err = inbox.ValidateKey(key)
	}
	if err != nil {
		req.claim.Key = key
		req.invalid = err
		return req, nil
	}
	req.claim.Key = key
	if c.cfg.Tenant != nil {
		tenant, err := c.cfg.Tenant(msg)
		if err == nil {
			tenant = cmp.Or(tenant, c.cfg.DefaultTenant)
			err = inboxdb.ValidateTenant(tenant)
		}
		if err == nil && tenant == "" && c.requireTenant {
			err = ErrTenantMissing
		}
		if err != nil {
			req.invalid = err
			return req, nil
		}
		req.claim.Tenant = tenant
	}

	if c.cfg.MessageTime != nil {
		if at, ok := c.cfg.MessageTime(msg); ok && time.Since(at) > c.cfg.Retention {
			c.metrics.expiredRetry.WithLabelValues(name).Inc()
			req.expiredCounted = true
			if c.cfg.FailExpiredRetry {
				req.invalid = fmt.Errorf("%w: sent %s ago, retention %s", ErrExpiredRetry, time.Since(at).Round(time.Second), c.cfg.Retention)
				req.recordable = true
				req.claim.Fingerprint, _ = inbox.SHA256(msg.Payload)
				return req, nil
			}
			c.log.Warn("idem: message older than the inbox retention; processing it, but its inbox row may be gone",
				append(req.attrs(), "age", time.Since(at).Round(time.Second), "retention", c.cfg.Retention)...)
		}
	}

	if c.defaultFP {
		req.sum = sha256.Sum256(msg.Payload)
		req.claim.Fingerprint = req.sum[:]
		return req, nil
	}
	fp, err := c.cfg.Fingerprint(msg.Payload)
	if err != nil {
		// The key is good, so the failure is recorded under it, with the raw
		// payload's fingerprint.
		req.invalid = err
		req.recordable = true
		req.claim.Fingerprint, _ = inbox.SHA256(msg.Payload)
		return req, nil
	}
	req.claim.Fingerprint = fp
	return req, nil
}
