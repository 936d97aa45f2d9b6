package effects

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/failgroup"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/schemacheck"
	"github.com/idemkit/idem/internal/text"
	"github.com/idemkit/idem/internal/tracing"
)

// ErrDispatcherRunning is returned by Run when the Dispatcher is already running.
var ErrDispatcherRunning = errcode.Transient("dispatcher_running", "dispatcher is already running")

// maxErrorLen caps the last_error stored for an effect.
const maxErrorLen = 2000

// Dispatcher claims due effects and carries them out with their kind's Sender.
// Any number of Dispatchers, in any number of processes, may serve one schema:
// claims skip rows that another holds, and fencing keeps a stale attempt from
// recording over a newer one. See the package documentation for the guarantees.
type Dispatcher struct {
	cfg    Config
	pool   *pgxpool.Pool
	q      queries
	log    *slog.Logger
	m      *metrics
	tracer trace.Tracer
	prop   propagation.TextMapPropagator
	lanes  []*lane // sorted by kind
	byKind map[string]*lane

	running  atomic.Bool
	wake     chan struct{} // a notification or a requeue: look for work now
	freed    chan struct{} // outcomes were recorded: capacity is free again
	outcomes chan outcome  // made by each Run, closed when it ends
	sendCtx  context.Context
	released atomic.Int64 // claims handed back unsent at shutdown, in this Run

	// shards, with a shard map, runs one Dispatcher a shard; the fields above
	// but cfg and log are then unused.
	shards *shardSet
}

// lane is one kind's sender, its workers' queue and its count of claims held.
type lane struct {
	kind        string
	sender      Sender
	concurrency int
	capacity    int
	queue       chan *claimed // made by each Run, closed when its claim loop ends
	held        atomic.Int64  // claimed and not yet recorded

	// The kind's series, looked up once rather than on every effect.
	lag      prometheus.Observer
	attempts map[string]prometheus.Counter // by outcome label
}

// claimed is an effect this Dispatcher holds a lease on.
type claimed struct {
	Delivery
	fence        int64
	maxAttempts  int
	prevInFlight bool          // the previous attempt's outcome is unknown
	lagAtClaim   time.Duration // due → claim, by the database's clock
	claimedAt    time.Time     // local time just before the claim statement ran
	trace        string        // the trace context the row kept (JSON), "" for none
	lane         *lane
	batch        *claimBatch
}

// claimBatch is what the effects of one claim statement share: their sends'
// context, which ends a tenth of the lease before the lease does (or at a forced
// shutdown), and a count of those not yet recorded. One context per claim rather
// than per effect: the effects of a claim have the same deadline.
type claimBatch struct {
	ctx    context.Context
	cancel context.CancelFunc
	left   atomic.Int64
}

// recorded counts one effect of the batch as recorded (or given up), and releases
// the context with the last one.
func (b *claimBatch) recorded() {
	if b.left.Add(-1) == 0 {
		b.cancel()
	}
}

// logAttrs name the effect and the attempt in logs.
func (c *claimed) logAttrs() []any {
	if c.Tenant != "" {
		return []any{"tenant", c.Tenant, "kind", c.Kind, "effect_key", c.Key, "attempt", c.Attempt}
	}
	return []any{"kind", c.Kind, "effect_key", c.Key, "attempt", c.Attempt}
}

// outcome is what to record for a claim.
type outcome struct {
	c        *claimed
	state    string // pending, done or dead (an operator discards, never the Dispatcher)
	delay    time.Duration
	inFlight bool // the outcome is unknown: reconcile before the next attempt
	undo     int  // 1: released without an attempt; give the attempt back
	err      string
	label    string // attempts_total outcome label
	// code and masked are a dead effect's error code and masked error text
	// (failgroup.Mask), which place it in its failure group.
	code, masked string
}

// NewDispatcher validates cfg, checks the schema once, and returns a Dispatcher.
//
// The check (unless cfg.SkipSchemaCheck) reads Postgres's catalog: Schema, or
// every shard's schema, must hold idem's tables at the newest migration this build
// knows, whichever tool applied them. A schema that lacks them, or lacks a newer
// migration, fails with an error of code schema_missing that names the schema,
// the missing versions and `idem migrate up`; with Shards the error names each
// shard that failed. NewDispatcher takes no context: the check gives up after 10 seconds. A
// database that does not answer is tried again within that time, so a process
// that starts while Postgres restarts comes up once it is back. After that, without
// Shards, NewDispatcher fails with code database_unavailable (nothing could be served; the
// process's supervisor should start it again); a shard that does not answer is
// logged and left out of the check, and the other shards are served, as when a
// shard goes down later.
// Call Run to start it.
func NewDispatcher(cfg Config) (*Dispatcher, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	if err := schemacheck.Start(cfg.SkipSchemaCheck, cfg.Logger, cfg.schemaTargets()); err != nil {
		return nil, err
	}
	if cfg.Shards != nil {
		return newShardedDispatcher(cfg)
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, fmt.Errorf("register metrics: %w", err)
	}
	d := &Dispatcher{
		cfg:    cfg,
		pool:   cfg.Pool,
		q:      newQueries(cfg.Schema, cfg.BatchSize*len(cfg.Senders), cfg.Tenant != ""),
		log:    cfg.Logger,
		m:      m,
		tracer: tracing.Tracer(cfg.TracerProvider),
		prop:   tracing.Propagator(cfg.Propagator),
		byKind: map[string]*lane{},
		wake:   make(chan struct{}, 1),
		freed:  make(chan struct{}, 1),
	}
	for kind, s := range cfg.Senders {
		n := cmp.Or(cfg.Concurrency[kind], DefaultConcurrency)
		capacity := n + min(n, cfg.BatchSize)
		l := &lane{kind: kind, sender: s, concurrency: n, capacity: capacity,
			lag: m.lag.WithLabelValues(kind), attempts: map[string]prometheus.Counter{}}
		for _, o := range attemptOutcomes {
			l.attempts[o] = m.attempts.WithLabelValues(kind, o)
		}
		d.lanes = append(d.lanes, l)
		d.byKind[kind] = l
		m.precreate(kind)
	}
	slices.SortFunc(d.lanes, func(a, b *lane) int { return strings.Compare(a.kind, b.kind) })
	return d, nil
}

// Run claims and sends effects until ctx ends, then shuts down gracefully: it
// stops claiming, waits up to ShutdownTimeout for the sends in flight (and then
// cancels them), records every outcome, and releases the claims it had not started
// so that another Dispatcher takes them at once. It returns nil after a clean
// shutdown.
func (d *Dispatcher) Run(ctx context.Context) error {
	if !d.running.CompareAndSwap(false, true) {
		return ErrDispatcherRunning
	}
	defer d.running.Store(false)
	if d.shards != nil {
		return d.shards.run(ctx)
	}

	// Sends outlive ctx by up to ShutdownTimeout, so they get a context of their own.
	d.outcomes = make(chan outcome, 4*d.cfg.BatchSize)
	sendCtx, cancelSends := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelSends()
	d.sendCtx = withPropagator(sendCtx, d.prop) // for PublishSender
	d.released.Store(0)
	for _, l := range d.lanes {
		l.queue = make(chan *claimed, l.capacity)
	}

	recorded := make(chan struct{})
	go func() { defer close(recorded); d.record() }()

	var background sync.WaitGroup
	background.Go(func() { d.listen(ctx) })
	if d.cfg.Registerer != nil {
		background.Go(func() { d.refreshPendingLoop(ctx) })
	}

	var workers sync.WaitGroup
	for _, l := range d.lanes {
		for range l.concurrency {
			workers.Go(func() { d.work(ctx, l) })
		}
	}
	d.log.Info("effects dispatcher started", "schema", d.cfg.Schema, "kinds", d.kinds())

	d.claimLoop(ctx)

	// Shutdown. The claim loop has stopped; workers finish their current send and
	// hand back what is left in their queue.
	for _, l := range d.lanes {
		close(l.queue)
	}
	done := make(chan struct{})
	go func() { workers.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(d.cfg.ShutdownTimeout):
		d.log.Warn("effects dispatcher: sends still running at the shutdown deadline; cancelling them")
		cancelSends()
		<-done
	}
	close(d.outcomes)
	<-recorded
	background.Wait()
	d.log.Info("effects dispatcher stopped", "schema", d.cfg.Schema, "released", d.released.Load())
	return nil
}

func (d *Dispatcher) kinds() []string {
	ks := make([]string, len(d.lanes))
	for i, l := range d.lanes {
		ks[i] = l.kind
	}
	return ks
}

// claimLoop claims effects while ctx lasts, as many as each kind has room for. It
// claims again at once while claims come back full, and otherwise sleeps until a
// notification, the poll interval, or (when a kind is full) recorded outcomes.
func (d *Dispatcher) claimLoop(ctx context.Context) {
	poll := time.NewTimer(0)
	defer poll.Stop()
	failures := 0
	for {
		kinds := make([]string, 0, len(d.lanes))
		limits := make([]int32, 0, len(d.lanes))
		full := false
		for _, l := range d.lanes {
			held := int(l.held.Load())
			n := min(l.capacity-held, d.cfg.BatchSize)
			// A claim costs about the same for 10 rows as for 100, so a busy kind
			// waits until it has room for a good batch; an idle one claims at once.
			if n <= 0 || held > 0 && n < min(d.cfg.BatchSize, l.capacity/2) {
				full = true
				continue
			}
			kinds = append(kinds, l.kind)
			limits = append(limits, int32(n))
		}
		more := false
		if len(kinds) > 0 {
			got, err := d.claim(ctx, kinds, limits)
			if err != nil {
				err = pgschema.Wrap(err, d.cfg.Schema)
				if ctx.Err() != nil {
					return
				}
				failures++
				d.log.Error("effects dispatcher: claim failed", "error", err)
				wait := min(time.Duration(failures)*100*time.Millisecond, d.cfg.PollInterval, 5*time.Second)
				select {
				case <-ctx.Done():
					return
				case <-time.After(wait):
				}
				continue
			}
			failures = 0
			perKind := map[string]int{}
			for _, c := range got {
				perKind[c.Kind]++
				c.lane.queue <- c // never blocks: held never exceeds the queue's capacity
			}
			for i, k := range kinds {
				if perKind[k] == int(limits[i]) {
					more = true
				}
			}
		}
		if ctx.Err() != nil {
			return
		}
		if more {
			continue
		}
		var freed chan struct{}
		if full {
			freed = d.freed
		}
		if !poll.Stop() {
			select {
			case <-poll.C:
			default:
			}
		}
		poll.Reset(d.cfg.PollInterval)
		select {
		case <-ctx.Done():
			return
		case <-d.wake:
		case <-freed:
		case <-poll.C:
		}
	}
}

// beginSQL begins the Dispatcher's transactions at READ COMMITTED whatever the
// session's default_transaction_isolation: under REPEATABLE READ or SERIALIZABLE a
// claim's FOR UPDATE SKIP LOCKED, or an outcome write, that meets a row another
// dispatcher changed after its snapshot fails with 40001 instead of moving on.
const beginSQL = "BEGIN ISOLATION LEVEL READ COMMITTED"

// claim runs the claim statement. It runs on a context that ctx's end does not
// cancel: a claim cut off after its commit would leave rows leased that nobody
// sends until the lease runs out.
func (d *Dispatcher) claim(ctx context.Context, kinds []string, limits []int32) ([]*claimed, error) {
	qctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	start := time.Now()
	// The claim runs in a transaction of its own, with the settings that fix its
	// plan (see claimSettings), sent as one pipelined round trip.
	b := &pgx.Batch{}
	b.Queue(beginSQL)
	for _, s := range claimSettings {
		b.Queue(s)
	}
	args := []any{kinds, limits, d.cfg.Lease}
	if d.cfg.Tenant != "" {
		args = append(args, d.cfg.Tenant)
	}
	b.Queue(d.q.claim, args...)
	b.Queue("COMMIT")
	br := d.pool.SendBatch(qctx, b)
	defer func() { _ = br.Close() }() // every result is read below; Close releases the connection
	for range 1 + len(claimSettings) {
		if _, err := br.Exec(); err != nil {
			return nil, err
		}
	}
	rows, err := br.Query()
	if err != nil {
		return nil, err
	}
	var out []*claimed
	for rows.Next() {
		c := &claimed{claimedAt: start}
		var lag float64
		err := rows.Scan(&c.Tenant, &c.Kind, &c.Key, &c.Payload, &c.Attempt, &c.maxAttempts, &c.fence,
			&c.prevInFlight, &c.CreatedAt, &lag, &c.Source.Consumer, &c.Source.Tenant, &c.Source.Key, &c.trace)
		if err != nil {
			rows.Close()
			return nil, err
		}
		c.lagAtClaim = time.Duration(lag * float64(time.Second))
		if d.cfg.MaxAttempts > 0 {
			c.maxAttempts = min(c.maxAttempts, d.cfg.MaxAttempts)
		}
		c.lane = d.byKind[c.Kind]
		c.lane.held.Add(1)
		out = append(out, c)
	}
	rows.Close()
	err = rows.Err()
	if err == nil {
		_, err = br.Exec() // COMMIT
	}
	if err != nil {
		// Whether the claim committed is unknown. Sending what was scanned could
		// overlap another dispatcher if it did not; if it did, those effects come due
		// again after the lease, in_flight, and are reconciled or resent then.
		for _, c := range out {
			c.lane.held.Add(-1)
		}
		return nil, err
	}
	if len(out) > 0 {
		lease := d.cfg.Lease
		b := &claimBatch{}
		b.ctx, b.cancel = context.WithDeadline(d.sendCtx, start.Add(lease-lease/10))
		b.left.Store(int64(len(out)))
		for _, c := range out {
			c.batch = b
		}
	}
	return out, nil
}

// work sends the effects of one lane until its queue is closed. A claim taken from
// the queue after ctx ended is released unsent.
func (d *Dispatcher) work(ctx context.Context, l *lane) {
	for c := range l.queue {
		if ctx.Err() != nil {
			d.released.Add(1)
			d.outcomes <- d.release(c)
			continue
		}
		d.outcomes <- d.attempt(c)
	}
}

// attempt carries out one claim, in its send span, and says what to record.
func (d *Dispatcher) attempt(c *claimed) outcome {
	ctx, span := d.startSend(c)
	o := d.attemptIn(ctx, c)
	endSend(span, o)
	return o
}

// startSend starts the span of one attempt: the root of a trace of its own (an
// effect is sent after the work that enqueued it ended, maybe hours later, and
// retried), linked to the trace context its row kept. The Sender gets it in ctx,
// so its own spans (an HTTP client's, a publish) nest under it.
func (d *Dispatcher) startSend(c *claimed) (context.Context, trace.Span) {
	if tracing.Off(d.cfg.TracerProvider) {
		return c.batch.ctx, noSpan // no provider installed: no span, no allocation
	}
	opts := sendSpanOptions
	if c.trace != "" {
		if sc := decodeTrace(c.trace); sc.IsValid() {
			opts = append(slices.Clip(opts), trace.WithLinks(trace.Link{SpanContext: sc}))
		}
	}
	ctx, span := d.tracer.Start(c.batch.ctx, "idem.send", opts...)
	if span.IsRecording() {
		span.SetAttributes(tracing.Kind.String(c.Kind), tracing.EffectKey.String(c.Key),
			tracing.Tenant.String(c.Tenant), tracing.Attempt.Int(c.Attempt))
		if c.Source.Consumer != "" {
			span.SetAttributes(tracing.Consumer.String(c.Source.Consumer), tracing.Key.String(c.Source.Key))
		}
	}
	return ctx, span
}

// noSpan is a span that does nothing.
var noSpan = trace.SpanFromContext(context.Background())

// sendSpanOptions are made once: options made per call cost allocations.
var sendSpanOptions = []trace.SpanStartOption{trace.WithNewRoot(), trace.WithSpanKind(trace.SpanKindProducer)}

// endSend ends an attempt's span with its outcome: done, reconciled, retry, dead
// or released (handed back unsent).
func endSend(span trace.Span, o outcome) {
	if span.IsRecording() {
		span.SetAttributes(tracing.Outcome.String(o.label))
		if o.err != "" {
			span.SetStatus(codes.Error, o.err)
		}
	}
	span.End()
}

// attemptIn is attempt in the send span's context.
func (d *Dispatcher) attemptIn(ctx context.Context, c *claimed) outcome {
	lease := d.cfg.Lease
	deadline := c.claimedAt.Add(lease - lease/10)
	if time.Until(deadline) < lease/4 {
		// The claim waited in the queue for most of its lease. Sending now could
		// overlap another dispatcher's claim of the same effect once the lease ends.
		return d.release(c)
	}
	shutdown := d.sendCtx

	if c.prevInFlight {
		log := d.log.With(c.logAttrs()...)
		if r, ok := c.lane.sender.(Reconciler); ok {
			done, err := reconcileSafely(ctx, r, c.Delivery)
			switch {
			case err != nil:
				d.m.reconcile.WithLabelValues(c.Kind, "error").Inc()
				d.m.unknown.WithLabelValues(c.Kind).Inc()
				log.Warn("effect outcome unknown: reconcile failed", "error", err)
				return d.failed(c, Indefinite(fmt.Errorf("reconcile: %w", err)), log)
			case done:
				d.m.reconcile.WithLabelValues(c.Kind, "done").Inc()
				log.Info("effect reconciled: the previous attempt took effect")
				return outcome{c: c, state: "done", label: "reconciled"}
			default:
				d.m.reconcile.WithLabelValues(c.Kind, "not_done").Inc()
			}
		} else {
			d.m.unknown.WithLabelValues(c.Kind).Inc()
			if c.Attempt <= c.maxAttempts {
				log.Warn("effect outcome of the previous attempt unknown (lease expired or indefinite error); sending again with the same key")
			}
		}
	}
	if c.Attempt > c.maxAttempts {
		// The last allowed attempt's outcome was unknown, and no Reconcile settled it.
		return d.dead(c, errors.New("attempts exhausted; the outcome of the last attempt is unknown"), c.prevInFlight, d.log.With(c.logAttrs()...))
	}

	c.lane.lag.Observe((c.lagAtClaim + time.Since(c.claimedAt)).Seconds())
	err := sendSafely(ctx, c.lane.sender, c.Delivery)
	if err == nil {
		return outcome{c: c, state: "done", label: "done"}
	}
	log := d.log.With(c.logAttrs()...)
	if ctx.Err() != nil && !IsPermanent(err) {
		// Cut off by the lease deadline or a forced shutdown: the receiver may have
		// the effect already.
		err = Indefinite(err)
		if shutdown.Err() != nil {
			// A forced shutdown, not the effect's fault: due again at once, and the
			// attempt still counts, since it may have happened.
			o := d.failed(c, err, log)
			o.delay = 0
			return o
		}
	}
	return d.failed(c, err, log)
}

// failed decides between a retry and dead for a failed attempt.
func (d *Dispatcher) failed(c *claimed, err error, log *slog.Logger) outcome {
	indefinite := IsIndefinite(err)
	if IsPermanent(err) {
		return d.dead(c, err, indefinite, log)
	}
	if c.Attempt >= c.maxAttempts {
		return d.dead(c, fmt.Errorf("max attempts (%d) reached: %w", c.maxAttempts, err), indefinite, log)
	}
	delay := d.cfg.Backoff.Delay(c.Attempt)
	log.Warn("effect attempt failed; will retry", "error", err, "retry_in", delay, "outcome_unknown", indefinite)
	return outcome{c: c, state: "pending", delay: delay, inFlight: indefinite, err: storedError(err), label: "retry"}
}

func (d *Dispatcher) dead(c *claimed, err error, inFlight bool, log *slog.Logger) outcome {
	log.Error("effect dead", "error", err)
	stored := storedError(err)
	return outcome{c: c, state: "dead", inFlight: inFlight, err: stored, label: "dead",
		code: text.Sanitize(errcode.Code(err), 0), masked: failgroup.Mask(stored)}
}

// release gives a claim back unsent: due now, the attempt returned, and in_flight
// as the claim found it.
func (d *Dispatcher) release(c *claimed) outcome {
	return outcome{c: c, state: "pending", inFlight: c.prevInFlight, undo: 1, label: "released"}
}

func sendSafely(ctx context.Context, s Sender, dl Delivery) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("sender panicked: %v\n%s", r, debug.Stack())
		}
	}()
	return s.Send(ctx, dl)
}

func reconcileSafely(ctx context.Context, r Reconciler, dl Delivery) (done bool, err error) {
	defer func() {
		if p := recover(); p != nil {
			done, err = false, fmt.Errorf("reconciler panicked: %v\n%s", p, debug.Stack())
		}
	}()
	return r.Reconcile(ctx, dl)
}

// storedError is err as last_error: this is the one place where an error becomes
// stored text. A sender's error may quote a binary response body or a panic value;
// one NUL byte or invalid UTF-8 sequence in it would make Postgres reject the whole
// outcome batch, so the text is sanitized and capped at maxErrorLen bytes.
func storedError(err error) string { return text.Sanitize(err.Error(), maxErrorLen) }

// record writes outcomes in batches until the outcomes channel is closed: it takes
// what is waiting, up to a limit, and records it in one statement.
func (d *Dispatcher) record() {
	limit := max(4*d.cfg.BatchSize, 256)
	batch := make([]outcome, 0, limit)
	for o := range d.outcomes {
		batch = append(batch[:0], o)
	drain:
		for len(batch) < limit {
			select {
			case o, ok := <-d.outcomes:
				if !ok {
					break drain
				}
				batch = append(batch, o)
			default:
				break drain
			}
		}
		d.recordBatch(batch)
		for _, o := range batch {
			o.c.lane.held.Add(-1)
			o.c.batch.recorded()
		}
		select {
		case d.freed <- struct{}{}:
		default:
		}
	}
}

func (d *Dispatcher) recordBatch(batch []outcome) {
	slices.SortFunc(batch, func(a, b outcome) int {
		return cmp.Or(strings.Compare(a.c.Tenant, b.c.Tenant), strings.Compare(a.c.Kind, b.c.Kind), strings.Compare(a.c.Key, b.c.Key))
	})
	notify := false
	var soonest time.Duration = -1
	for _, o := range batch {
		if o.state == "pending" {
			if o.delay == 0 {
				notify = true
			} else if soonest < 0 || o.delay < soonest {
				soonest = o.delay
			}
		}
	}
	status, err := d.writeOutcomes(batch)
	if err != nil && isDataError(err) {
		// One row's data broke the statement (a constraint of the user's, an
		// encoding the server cannot take). The batch is all or nothing, so write
		// each outcome on its own: one bad outcome must not cost the others theirs.
		d.log.Warn("effects dispatcher: an outcome batch was rejected for its data; writing each outcome on its own", "error", err, "outcomes", len(batch))
		status, err = d.writeOneByOne(batch), nil
	}
	if err != nil {
		// The leases will run out and the effects will be claimed again: nothing is
		// lost, though a sent effect will be sent once more.
		d.log.Error("effects dispatcher: recording outcomes failed; the effects will be retried after their lease", "error", err, "outcomes", len(batch))
		return
	}
	for i, o := range batch {
		switch status[i] {
		case notWritten:
			// logged where it failed
		case leaseLost:
			d.m.lostLease.WithLabelValues(o.c.Kind).Inc()
			d.log.Warn("effect lease lost: it was claimed again before this attempt's outcome was recorded",
				append(o.c.logAttrs(), "outcome", o.label)...)
		case recorded:
			o.c.lane.attempts[o.label].Inc()
			if o.state == "dead" {
				d.m.dead.WithLabelValues(o.c.Kind).Inc()
			}
		}
	}
	if notify {
		// Released claims are due now; wake every dispatcher, this one included.
		_ = retry(func(ctx context.Context) error {
			_, err := d.pool.Exec(ctx, d.q.notify, d.cfg.Schema)
			return err
		})
	}
	if soonest >= 0 && soonest < d.cfg.PollInterval {
		time.AfterFunc(soonest, d.signalWake)
	}
}

// outcomeStatus is what became of one outcome of a batch.
type outcomeStatus uint8

const (
	notWritten outcomeStatus = iota // the write failed
	leaseLost                       // written, but the effect had been claimed again
	recorded
)

// writeOutcomes records batch in one transaction, retried on errors that may pass
// (a cut connection, a failover) but not on a data error, which the same rows would
// hit again. It returns, for each outcome of the batch in order, recorded or
// leaseLost (the lease was lost to a newer claim).
//
// The write is retried even when its COMMIT may have gone through (a connection
// cut after COMMIT was sent): the record statement is idempotent (see queries.go),
// so the retry changes nothing that the first run changed, and still reports those
// rows as recorded.
func (d *Dispatcher) writeOutcomes(batch []outcome) ([]outcomeStatus, error) {
	n := len(batch)
	tenants, kinds, keys, states, errs := make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]*string, n)
	codes, masked := make([]*string, n), make([]*string, n)
	fences, delays := make([]int64, n), make([]int64, n)
	inFlight, undo := make([]bool, n), make([]int32, n)
	for i, o := range batch {
		tenants[i], kinds[i], keys[i], fences[i], states[i] = o.c.Tenant, o.c.Kind, o.c.Key, o.c.fence, o.state
		delays[i], inFlight[i], undo[i] = o.delay.Milliseconds(), o.inFlight, int32(o.undo)
		if o.err != "" {
			errs[i] = &o.err
		}
		if o.state == "dead" {
			codes[i], masked[i] = &batch[i].code, &batch[i].masked
		}
	}
	status := make([]outcomeStatus, n)
	args := []any{tenants, kinds, keys, fences, states, delays, inFlight, undo, errs, codes, masked}
	record, recordAgain := d.q.record, d.q.recordAgain
	if oneTenant(tenants) {
		// One tenant's outcomes: the forms that filter on it, for a router.
		record, recordAgain = d.q.recordOne, d.q.recordAgainOne
		args = append(args, batch[0].c.Tenant)
	}
	err := retryUnless(isDataError, func(ctx context.Context) error {
		for i := range status {
			status[i] = leaseLost
		}
		// One round trip: the outcome commits without waiting for its WAL flush.
		// That is safe here, and only here: if the server crashes and loses this
		// commit, each row goes back to the claim before it, which is durable and
		// in_flight, so the effect is reconciled or sent again after its lease. The
		// claim itself always commits synchronously. recordSettings also fix the
		// plan, as for the claim.
		b := &pgx.Batch{}
		b.Queue(beginSQL)
		for _, s := range recordSettings {
			b.Queue(s)
		}
		q := record
		record = recordAgain // a retry may find this run committed
		b.Queue(q, args...).Query(func(rows pgx.Rows) error {
			var i int64
			_, err := pgx.ForEachRow(rows, []any{&i}, func() error {
				if i < 1 || i > int64(n) {
					return fmt.Errorf("idem: outcome write returned ordinal %d of %d", i, n)
				}
				status[i-1] = recorded
				return nil
			})
			return err
		})
		b.Queue(`COMMIT`)
		return d.pool.SendBatch(ctx, b).Close()
	})
	if err != nil {
		return nil, err
	}
	return status, nil
}

// writeOneByOne records each outcome in a transaction of its own. An outcome whose
// row is still rejected for its data is written once more without its error text;
// if even that fails, it is left to its lease (logged, and notWritten), and the
// others are kept.
func (d *Dispatcher) writeOneByOne(batch []outcome) []outcomeStatus {
	status := make([]outcomeStatus, len(batch))
	for i, o := range batch {
		one, err := d.writeOutcomes([]outcome{o})
		if err != nil && isDataError(err) && o.err != "" {
			o.err = "idem: this attempt's error text could not be stored (" + text.Sanitize(err.Error(), 200) + ")"
			one, err = d.writeOutcomes([]outcome{o})
		}
		if err != nil {
			d.log.Error("effects dispatcher: recording an outcome failed; the effect will be retried after its lease",
				append(o.c.logAttrs(), "error", err, "outcome", o.label)...)
			continue
		}
		status[i] = one[0]
	}
	return status
}

// isDataError reports an error that the same rows will hit again: a data exception
// (class 22, such as 22021 invalid text) or an integrity violation (class 23, such
// as a CHECK constraint).
func isDataError(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	return strings.HasPrefix(pgErr.Code, "22") || strings.HasPrefix(pgErr.Code, "23")
}

func (d *Dispatcher) signalWake() {
	select {
	case d.wake <- struct{}{}:
	default:
	}
}

// retry runs f up to three times, each with its own timeout, for writes that must
// happen even while Run's context is ending.
func retry(f func(ctx context.Context) error) error {
	return retryUnless(func(error) bool { return false }, f)
}

// retryUnless is retry that gives up at once on an error for which final is true.
func retryUnless(final func(error) bool, f func(ctx context.Context) error) error {
	var err error
	for i := range 3 {
		if i > 0 {
			time.Sleep(time.Duration(i) * 200 * time.Millisecond)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err = f(ctx)
		cancel()
		if err == nil || final(err) {
			return err
		}
	}
	return err
}

// listen wakes the claim loop on each notification for this schema. It holds one
// connection of its own, outside the pool, and reconnects when it drops; after a
// reconnect it wakes the loop once, for notifications missed meanwhile.
//
// The wait before a reconnect doubles, from listenBackoffInitial up to
// listenBackoffMax, while attempts keep failing, and starts again from the initial
// wait once a connection got as far as LISTEN: a cut of a connection that worked is
// a new incident, and every moment without LISTEN delays wake-ups (up to the poll
// interval).
func (d *Dispatcher) listen(ctx context.Context) {
	wait := listenBackoffInitial
	for ctx.Err() == nil {
		listened, err := d.listenOnce(ctx)
		if ctx.Err() != nil {
			return
		}
		if listened {
			wait = listenBackoffInitial
		}
		d.log.Warn("effects dispatcher: LISTEN connection lost; polling until it is back", "error", err, "retry_in", wait)
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		wait = min(2*wait, listenBackoffMax)
	}
}

// The LISTEN connection's reconnect backoff.
const (
	listenBackoffInitial = 100 * time.Millisecond
	listenBackoffMax     = 5 * time.Second
)

// listenOnce connects, listens and wakes the claim loop on notifications until the
// connection fails. listened reports whether it got as far as LISTEN.
func (d *Dispatcher) listenOnce(ctx context.Context) (listened bool, err error) {
	cc := d.cfg.ListenConnConfig
	if cc == nil {
		cc = d.pool.Config().ConnConfig
	}
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		return false, err
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = conn.Close(cctx)
	}()
	if _, err := conn.Exec(ctx, "LISTEN "+notifyChannel); err != nil {
		return false, err
	}
	d.signalWake()
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return true, err
		}
		if n.Payload == d.cfg.Schema {
			d.signalWake()
		}
	}
}

func (d *Dispatcher) refreshPendingLoop(ctx context.Context) {
	t := time.NewTicker(d.cfg.PendingRefresh)
	defer t.Stop()
	// Kinds whose gauge this loop has set: each is set on every refresh, to 0 once it
	// has no pending effects, so that no kind's gauge is left at a stale count.
	seen := map[string]bool{}
	for _, l := range d.lanes {
		seen[l.kind] = true
	}
	for {
		d.refreshPending(ctx, seen)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// refreshPending sets idem_effects_pending for every kind that has pending effects,
// whether or not this Dispatcher sends it, and to 0 for every kind in seen that has
// none (this Dispatcher's kinds, and kinds counted before). It adds the counted kinds
// to seen.
func (d *Dispatcher) refreshPending(ctx context.Context, seen map[string]bool) {
	rows, err := d.pool.Query(ctx, d.q.pending)
	if err != nil {
		if ctx.Err() == nil {
			d.log.Warn("effects dispatcher: counting pending effects failed", "error", err)
		}
		return
	}
	counts := map[string]float64{}
	var kind string
	var n int64
	_, err = pgx.ForEachRow(rows, []any{&kind, &n}, func() error { counts[kind] = float64(n); return nil })
	if err != nil {
		return
	}
	for k := range counts {
		seen[k] = true
	}
	for k := range seen {
		d.m.pending.WithLabelValues(k).Set(counts[k])
	}
}
