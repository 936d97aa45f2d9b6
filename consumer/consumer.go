package consumer

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"cmp"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/citusmode"
	"github.com/idemkit/idem/internal/text"
	"github.com/idemkit/idem/internal/tracing"
	"github.com/idemkit/idem/internal/txmark"
)

// Consumer runs Watermill messages through the inbox. Use its Middleware on a
// router handler. It is safe for concurrent use.
type Consumer struct {
	cfg        Config
	store      *inbox.Store
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
	group    *groupCommitter   // GroupCommit mode, started by the first message
	batches  []*groupCommitter // one per HandleBatch, each started by its first message
	stop     sync.Once
	// orderOnce logs the first message refused for a PoisonQueue inside idem.
	orderOnce sync.Once

	// citus: whether the schema is distributed by Citus, asked once (txOptions).
	citus citusmode.Detector

	// sharded: this is one shard's Consumer of a sharded one, so a message without
	// a tenant is refused (ErrTenantMissing), never routed by the empty tenant.
	sharded bool
	// shards, with a shard map, routes each message to its shard's Consumer; the
	// fields above are then unused.
	shards *shards
}

// New validates cfg and returns a Consumer.
func New(cfg Config) (*Consumer, error) {
	defaultFP := cfg.Fingerprint == nil
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	if cfg.Shards != nil {
		return newSharded(cfg, defaultFP)
	}
	store, err := inbox.NewStore(cfg.Schema)
	if err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, fmt.Errorf("register metrics: %w", err)
	}
	c := &Consumer{cfg: cfg, store: store, batchStore: newBatchStore(cfg.Schema), metrics: m, log: cfg.Logger,
		tracer: tracing.Tracer(cfg.TracerProvider), prop: tracing.Propagator(cfg.Propagator),
		prelude: []string{
			// SET LOCAL takes no bind parameters; the value is an integer we format.
			"SET LOCAL lock_timeout = " + strconv.FormatInt(max(cfg.LockTimeout.Milliseconds(), 1), 10),
			txmark.Mark,
		},
	}
	c.defaultFP = defaultFP
	c.setPrelude = append(slices.Clone(c.prelude), guardSQL(cfg.Schema), "SAVEPOINT idem_batch")
	if cfg.Name != "" {
		m.init(cfg.Name)
		c.seen.Store(cfg.Name, struct{}{})
	}
	return c, nil
}

// Close makes the consumer refuse new messages (they get ErrClosed and are nacked),
// waits for the messages in progress to finish, and stops the group-commit workers.
// It is safe to call at any time, from any goroutine, and more than once; it is
// final. Close the router first, so that no message is refused needlessly.
func (c *Consumer) Close() error {
	if c.shards != nil {
		return c.shards.close()
	}
	c.stop.Do(func() {
		c.mu.Lock()
		c.closed = true
		groups := slices.Clone(c.batches)
		if c.group != nil {
			groups = append(groups, c.group)
		}
		c.mu.Unlock()
		// No delivery enters after closed is set, so Wait cannot race an Add.
		c.inflight.Wait()
		for _, g := range groups {
			g.close()
		}
	})
	return nil
}

// enter admits one delivery, starting the group-commit workers on first use. It
// reports false after Close. Every admitted delivery calls c.inflight.Done.
func (c *Consumer) enter() (*groupCommitter, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, false
	}
	c.inflight.Add(1)
	if c.cfg.Mode == GroupCommit && c.group == nil {
		c.group = newGroupCommitter(c, nil)
	}
	return c.group, true
}

// enterBatch is enter for a HandleBatch handler, whose committer lives in *slot.
func (c *Consumer) enterBatch(slot **groupCommitter, h BatchHandler) (*groupCommitter, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, false
	}
	c.inflight.Add(1)
	if *slot == nil {
		*slot = newGroupCommitter(c, h)
		c.batches = append(c.batches, *slot)
	}
	return *slot, true
}

type txKey struct{}

// ownedTx is the transaction a handler sees. idem owns it: Commit and Rollback are
// refused, because in group-commit mode the handler's work is part of a transaction
// shared with other messages, and in every mode the commit must cover the inbox row
// too. Return an error instead to roll back. Raw SQL that ends the
// transaction (Exec "COMMIT" or "ROLLBACK") cannot be refused; idem detects it
// and records the key as failed with ErrTxEnded (see tx.go).
type ownedTx struct{ pgx.Tx }

func (ownedTx) Commit(context.Context) error   { return ErrTxOwned }
func (ownedTx) Rollback(context.Context) error { return ErrTxOwned }

// Tx returns the transaction the consumer opened for the message being handled.
// Business writes and effects.Enqueue go through it. In group-commit mode (and in a
// BatchHandler) it is shared with the other messages of a batch: do not assume it
// is the whole transaction. Never end it yourself, with its methods or with raw SQL
// (COMMIT, ROLLBACK): return nil to commit and an error to roll back. A handler
// that ends it has its key recorded as failed (ErrTxEnded).
//
// Outside idem's middleware there is no transaction, and Tx panics with ErrNoTx,
// whose text says what to fix: the consumer's Middleware is not around this
// handler, or a middleware that calls Tx is outside idem's, or ctx is not the
// message's context. TxSafely returns the error instead.
func Tx(ctx context.Context) pgx.Tx {
	tx, err := TxSafely(ctx)
	if err != nil {
		panic(err)
	}
	return tx
}

// TxSafely is Tx, returning ErrNoTx (code "no_transaction") instead of panicking
// when ctx carries no idem transaction.
func TxSafely(ctx context.Context) (pgx.Tx, error) {
	if tx, _ := ctx.Value(txKey{}).(pgx.Tx); tx != nil {
		return tx, nil
	}
	return nil, ErrNoTx
}

// Middleware is the Watermill handler middleware.
func (c *Consumer) Middleware(h message.HandlerFunc) message.HandlerFunc {
	if inner := innerMiddleware(h); inner != "" {
		return c.wrongOrderHandler(inner)
	}
	if c.shards != nil {
		return c.shards.middleware(h)
	}
	return func(msg *message.Message) ([]*message.Message, error) {
		req, err := c.prepare(msg)
		if err != nil {
			return nil, err
		}
		defer endPanicked(req)
		group, ok := c.enter()
		if !ok {
			return nil, c.finish(req, outcome{kind: outTransient, err: ErrClosed})
		}
		defer c.inflight.Done()
		if req.invalid != nil {
			return nil, c.finish(req, c.recordFailure(req, req.invalid))
		}
		switch c.cfg.Mode {
		case GroupCommit:
			return nil, group.submit(req, h)
		case Lease:
			return nil, c.handleLease(req, h)
		default:
			return nil, c.handleOne(req, h)
		}
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
	claim    inbox.Claim
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
func (c *Consumer) noteExpired(req *request, res inbox.ClaimResult) {
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
func (c *Consumer) prepare(msg *message.Message) (*request, error) {
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
	if err == nil {
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
			err = inbox.ValidateTenant(tenant)
		}
		if err == nil && tenant == "" && c.sharded {
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
			if c.cfg.ExpiredRetry == ExpiredRetryFail {
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

type outcomeKind int

const (
	outCommitted outcomeKind = iota // handler work is in the transaction; commit it
	outDuplicate                    // key completed before: ack
	outReplayed                     // key failed before: ack, replay to hooks
	outMismatch                     // same key, other payload
	outTransient                    // nack
	outBusy                         // key busy: nack after BusyDelay
	outPermanent                    // handler failed permanently: record it
	outRecorded                     // the permanent failure is recorded
	outRejected                     // invalid message that cannot be recorded
	// outEnded: the handler ended idem's transaction (ErrTxEnded). Once the
	// delivery's connection is back in the pool, recordEnded records the key as
	// failed in a fresh transaction; finish never sees this kind.
	outEnded
)

type outcome struct {
	kind outcomeKind
	err  error
	rec  *inbox.Record
	// claimFailed: err came from the claim's round trip, before the handler ran.
	claimFailed bool
}

// handleOne is the transactional mode: one transaction per message.
func (c *Consumer) handleOne(req *request, h message.HandlerFunc) error {
	ctx := req.ctx
	tx, err := c.begin(ctx)
	if err != nil {
		return c.finish(req, canceled(ctx, outcome{kind: outTransient, err: fmt.Errorf("begin: %w", err)}))
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	o := c.runInTx(req, tx, c.prelude, h)
	switch o.kind {
	case outCommitted:
		_, span := c.child(ctx, spanCommit)
		err := c.commit(ctx, tx)
		endSpan(span, err)
		switch {
		case errors.Is(err, ErrTxEnded):
			o = outcome{kind: outEnded, err: err}
		case err != nil:
			o = outcome{kind: outTransient, err: err}
		}
	case outPermanent:
		_ = tx.Rollback(context.WithoutCancel(ctx))
		o = c.recordFailure(req, o.err)
	}
	if o.kind == outEnded {
		// The connection goes back to the pool (rolling back a transaction the
		// handler began in place of idem's) before the failure is recorded.
		_ = tx.Rollback(context.WithoutCancel(ctx))
		return c.finish(req, c.recordEnded(req, o.err))
	}
	return c.finish(req, canceled(ctx, o))
}

// canceled reports a transient failure that a cancelled message context caused
// (pgx refuses to send, or cuts, a statement under it) as ErrCanceled: nothing of
// the message was committed.
func canceled(ctx context.Context, o outcome) outcome {
	if o.kind == outTransient && ctx.Err() != nil && Code(o.err) == "" &&
		(errors.Is(o.err, context.Canceled) || errors.Is(o.err, context.DeadlineExceeded)) {
		o.err = fmt.Errorf("%w (%v)", ErrCanceled, o.err)
	}
	return o
}

func (c *Consumer) setLockTimeout(ctx context.Context, tx pgx.Tx) error {
	_, err := tx.Exec(ctx, c.prelude[0])
	return err
}

// runInTx claims the key in tx and, if it owns the key, runs the handler and stores
// its output messages, all in tx. It never commits. The prelude statements (SET
// LOCAL, SAVEPOINT) go to the server in the claim's round trip.
func (c *Consumer) runInTx(req *request, tx pgx.Tx, prelude []string, h message.HandlerFunc) outcome {
	ctx, span := c.child(req.ctx, spanClaim)
	start := time.Now()
	res, err := c.store.ClaimAfterTx(ctx, tx, prelude, req.claim)
	c.metrics.lockWait.WithLabelValues(req.claim.Consumer).Observe(time.Since(start).Seconds())
	if err == nil && span.IsRecording() {
		span.SetAttributes(tracing.Outcome.String(claimOutcome(res)))
	}
	endSpan(span, err)
	if err != nil {
		o := classify(err)
		o.claimFailed = true
		return o
	}
	c.noteExpired(req, res)
	if !res.Claimed {
		return existingOutcome(res)
	}
	return c.runHandler(req, tx, h)
}

// runHandler runs h with tx in its context and stores what it returns.
func (c *Consumer) runHandler(req *request, tx pgx.Tx, h message.HandlerFunc) outcome {
	return c.runHandlerBuffered(req, tx, ownedTx{tx}, h, nil)
}

// scope is the effects scope of req's handler. With buf, Enqueue adds effects to
// it, for the batch to write them all at once.
func (c *Consumer) scope(req *request, buf *effects.Buffer) effects.Scope {
	return effects.Scope{
		Schema: c.cfg.Schema,
		Source: effects.Source{Consumer: req.claim.Consumer, Tenant: req.claim.Tenant, Key: req.claim.Key},
		Kinds:  c.cfg.EffectKinds,
		Buffer: buf,
	}
}

// handlerContext is the context a handler runs with: its transaction as idem's
// ownedTx (owned, wrapped once by the caller) and its effects scope.
func (c *Consumer) handlerContext(ctx context.Context, owned pgx.Tx, scope effects.Scope) context.Context {
	return effects.WithScope(context.WithValue(ctx, txKey{}, owned), scope)
}

// runHandlerBuffered is runHandler with effects and output messages going to buf
// (written now when buf is nil). owned is tx as the handler sees it (ownedTx).
func (c *Consumer) runHandlerBuffered(req *request, tx, owned pgx.Tx, h message.HandlerFunc, buf *effects.Buffer) outcome {
	scope := c.scope(req, buf)
	sctx, span := c.child(req.ctx, spanHandler)
	hctx := c.handlerContext(sctx, owned, scope)
	mark := poisonMark(req.msg)
	out, err := func() (out []*message.Message, err error) {
		req.msg.SetContext(hctx)
		defer req.msg.SetContext(req.msgCtx) // even if h panics: the message is not ours
		defer func() { endSpan(span, err) }()
		return h(req.msg)
	}()
	if err == nil && poisonMark(req.msg) != mark {
		err = c.poisonedInside(req)
	}
	// Before idem sends anything more: a transaction the handler ended would run
	// idem's statements outside any transaction, each committing on its own.
	if serr := txState(tx); serr != nil && (err == nil || errors.Is(serr, ErrTxEnded)) {
		if err != nil {
			serr = fmt.Errorf("%w (the handler returned: %v)", serr, err)
		}
		if errors.Is(serr, ErrTxEnded) {
			return outcome{kind: outEnded, err: serr}
		}
		return outcome{kind: outTransient, err: serr}
	}
	if err == nil {
		err = c.storeOutput(sctx, req, tx, scope, out)
	}
	if err != nil {
		if IsPermanent(err) {
			return outcome{kind: outPermanent, err: err}
		}
		return classify(err)
	}
	return outcome{kind: outCommitted}
}

// outputNamespace is the UUIDv5 namespace of output message IDs.
var outputNamespace = uuid.MustParse("6f1b7a3e-8c44-4d39-9f0e-1d2c3b4a5e60")

// OutputUUID is the UUID of the index-th message that consumer's handler returned for
// key (and tenant). It is the same on every run, so a re-run stores nothing new.
func OutputUUID(consumer, tenant, key string, index int) string {
	name := consumer + "\x00" + tenant + "\x00" + key + "\x00" + strconv.Itoa(index)
	return uuid.NewSHA1(outputNamespace, []byte(name)).String()
}

// storeOutput stores the handler's returned messages as publish effects, in tx. It
// stores copies with the derived UUIDs and never changes the messages themselves:
// a handler may return a message it did not create, such as the one it received
// (forwarding), and the output's identity must not leak into it. If it did, a retry
// of that message (middleware.Retry outside idem) would claim the output UUID as its
// key and commit the work a second time under a second key.
func (c *Consumer) storeOutput(ctx context.Context, req *request, tx pgx.Tx, scope effects.Scope, out []*message.Message) error {
	if len(out) == 0 {
		return nil
	}
	// Looked up only now: it walks the whole context chain when there is none.
	topic := message.PublishTopicFromCtx(req.ctx)
	if topic == "" {
		return ErrNoPublishTopic
	}
	scope.Kinds = nil // publish effects are the consumer's own, not the handler's
	for i, m := range out {
		if m == nil {
			return Permanent(fmt.Errorf("the handler returned a nil message at index %d", i))
		}
		m = m.Copy()
		m.UUID = OutputUUID(req.claim.Consumer, req.claim.Tenant, req.claim.Key, i)
		e, err := effects.PublishEffect(topic, m)
		if err != nil {
			return Permanent(err)
		}
		if _, err := effects.EnqueueScoped(ctx, tx, scope, e); err != nil {
			return err
		}
	}
	return nil
}

func existingOutcome(res inbox.ClaimResult) outcome {
	rec := res.Existing
	switch {
	case res.Mismatch:
		return outcome{kind: outMismatch, rec: rec, err: fmt.Errorf("%w: consumer %q key %q", ErrFingerprintMismatch, rec.Consumer, rec.Key)}
	case rec.State == inbox.StateCompleted:
		return outcome{kind: outDuplicate, rec: rec}
	case rec.State == inbox.StateFailed:
		return outcome{kind: outReplayed, rec: rec}
	default: // a fresh lease held by another delivery
		return outcome{kind: outBusy, rec: rec, err: inbox.ErrLeaseHeld}
	}
}

// recordFailure records a permanent failure in a transaction of its own.
func (c *Consumer) recordFailure(req *request, cause error) outcome {
	return c.recordFailureCtx(req.ctx, req, cause)
}

// recordFailureCtx is recordFailure under ctx.
func (c *Consumer) recordFailureCtx(ctx context.Context, req *request, cause error) outcome {
	if !req.recordable && req.invalid != nil {
		return outcome{kind: outRejected, err: cause}
	}
	var res inbox.ClaimResult
	err := pgx.BeginTxFunc(ctx, c.cfg.Pool, c.txOptions(ctx, ""), func(tx pgx.Tx) error {
		if err := c.setLockTimeout(ctx, tx); err != nil {
			return err
		}
		var err error
		res, err = c.store.FailTx(ctx, tx, req.claim, failureCode(cause), truncate(cause.Error()))
		return err
	})
	if err != nil {
		return notRecorded(cause, err)
	}
	c.noteExpired(req, res)
	if !res.Claimed {
		return existingOutcome(res)
	}
	return outcome{kind: outRecorded, err: cause}
}

// recordEnded settles the key of a handler that ended idem's transaction (cause is
// ErrTxEnded): statements it ran after that committed on their own, so running it
// again could write them twice. The key is recorded as failed with ErrTxEnded's
// code in a fresh transaction. Call it only once the delivery holds no connection:
// the recording takes one from the pool. It runs under a context the message's
// cancellation cannot cut, bounded by CommitTimeout: a recording cut short would let
// a redelivery run the handler again. If the key's row is there already (the
// handler's own COMMIT committed the claim), the key is settled as that row says,
// and this delivery is still answered as the failure it is.
func (c *Consumer) recordEnded(req *request, cause error) outcome {
	c.logEnded(req, cause)
	ctx, cancel := context.WithTimeout(context.WithoutCancel(req.ctx), c.cfg.CommitTimeout)
	defer cancel()
	o := c.recordFailureCtx(ctx, req, cause)
	switch o.kind {
	case outDuplicate, outReplayed:
		return outcome{kind: outRecorded, err: cause}
	}
	return o
}

// logEnded says, loudly, that req's handler ended idem's transaction.
func (c *Consumer) logEnded(req *request, cause error) {
	c.log.Error("idem: the handler ended idem's transaction itself (raw COMMIT or ROLLBACK); statements after that committed on their own, so the key is recorded as failed and never run again. Return an error to roll back instead",
		append(req.attrs(), "err", cause)...)
}

// notRecorded is the outcome when recording a permanent failure failed: nothing is
// recorded, so the message is nacked and the redelivery fails the same way again.
func notRecorded(cause, err error) outcome {
	o := classify(err)
	if o.kind == outPermanent {
		o.kind = outTransient
	}
	o.err = fmt.Errorf("record permanent failure (%v): %w", cause, o.err)
	return o
}

func failureCode(err error) string {
	if code := Code(err); code != "" {
		return code
	}
	return "permanent"
}

// truncate makes an error's text the inbox row's stored error: valid text for
// Postgres (a NUL byte or invalid UTF-8 in a handler's error would make the insert
// fail, and the permanent failure would never be recorded) and at most MaxErrorLen
// bytes.
func truncate(s string) string { return text.Sanitize(s, MaxErrorLen) }

// classify turns an error from Postgres or a handler into a transient outcome.
func classify(err error) outcome {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == pgerrcode.LockNotAvailable {
		return outcome{kind: outBusy, err: fmt.Errorf("%w: %v", ErrBusy, err)}
	}
	if IsPermanent(err) {
		return outcome{kind: outPermanent, err: err}
	}
	return outcome{kind: outTransient, err: err}
}

// finish turns an outcome into the middleware's answer (nil acks, an error nacks or
// poisons, with its code left on the message: MetadataErrorCode), with metrics,
// logs and hooks.
func (c *Consumer) finish(req *request, o outcome) (err error) {
	defer func() { markErrorCode(req.msg, err) }()
	endMessage(req, o)
	name := req.claim.Consumer
	switch o.kind {
	case outCommitted:
		c.metrics.processed.WithLabelValues(name).Inc()
		return nil
	case outDuplicate:
		c.metrics.duplicates.WithLabelValues(name).Inc()
		if o.rec.CompletedAt != nil {
			c.metrics.duplicateAge.WithLabelValues(name).Observe(o.rec.Now.Sub(*o.rec.CompletedAt).Seconds())
		}
		c.log.Debug("idem: duplicate acked", req.attrs()...)
		return nil
	case outReplayed:
		c.metrics.failed.WithLabelValues(name, o.rec.ErrorCode, "true").Inc()
		c.log.Info("idem: redelivery of a failed key acked", append(req.attrs(), "code", o.rec.ErrorCode)...)
		c.hook(req, Failure{Code: o.rec.ErrorCode, Error: o.rec.Error, Replayed: true})
		return nil
	case outMismatch:
		c.metrics.mismatch.WithLabelValues(name).Inc()
		c.log.Error("idem: key reused with a different payload", req.attrs()...)
		return o.err
	case outBusy:
		c.metrics.transientNack.WithLabelValues(name, "busy").Inc()
		c.log.Info("idem: key busy, nacking", append(req.attrs(), "err", o.err)...)
		select {
		case <-time.After(c.cfg.BusyDelay):
		case <-req.ctx.Done():
		}
		if !errors.Is(o.err, ErrBusy) {
			o.err = fmt.Errorf("%w: %v", ErrBusy, o.err)
		}
		return o.err
	case outTransient, outEnded: // outEnded never comes here (recordEnded settles it)
		if Code(o.err) == "" && connectionLost(o.err) {
			o.err = fmt.Errorf("%w: %w", ErrDatabaseUnavailable, o.err)
		}
		code := cmp.Or(Code(o.err), "transient")
		c.metrics.transientNack.WithLabelValues(name, code).Inc()
		if errors.Is(o.err, ErrMessageNotInBatch) {
			c.log.Error("idem: the batch handler named a message that is not in its batch; nacking", append(req.attrs(), "err", o.err)...)
		} else {
			c.log.Info("idem: transient failure, nacking", append(req.attrs(), "err", o.err)...)
		}
		return o.err
	case outRejected:
		code := failureCode(o.err)
		c.metrics.failed.WithLabelValues(name, code, "false").Inc()
		c.log.Error("idem: message rejected; it has no valid key (or, over a shard map, no tenant), so the failure cannot be recorded and the message is returned as an error (nacked, or poisoned by a PoisonQueue)",
			append(req.attrs(), "code", code, "err", o.err)...)
		c.hook(req, Failure{Code: code, Error: o.err.Error()})
		return o.err
	case outRecorded, outPermanent:
		code := failureCode(o.err)
		c.metrics.failed.WithLabelValues(name, code, "false").Inc()
		c.log.Warn("idem: permanent failure recorded", append(req.attrs(), "code", code, "err", o.err)...)
		c.hook(req, Failure{Code: code, Error: o.err.Error()})
		if c.cfg.OnPermanent == PoisonOnPermanent {
			return &FailedError{Consumer: name, Tenant: req.claim.Tenant, Key: req.claim.Key, Err: o.err}
		}
		return nil
	}
	return fmt.Errorf("idem: unknown outcome %d", o.kind)
}

func (c *Consumer) hook(req *request, f Failure) {
	if c.cfg.OnFailure == nil {
		return
	}
	f.Consumer, f.Tenant, f.Key = req.claim.Consumer, req.claim.Tenant, req.claim.Key
	c.cfg.OnFailure(req.ctx, f)
}
