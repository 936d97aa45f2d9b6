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
	"github.com/jackc/pgx/v5/pgxpool"
)

// ErrDispatcherRunning is returned by Run when the Dispatcher is already running.
var ErrDispatcherRunning = errors.New("idem: dispatcher is already running")

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
	lanes  []*lane // sorted by kind
	byKind map[string]*lane

	running  atomic.Bool
	wake     chan struct{} // a notification or a requeue: look for work now
	freed    chan struct{} // outcomes were recorded: capacity is free again
	outcomes chan outcome  // made by each Run, closed when it ends
}

// lane is one kind's sender, its workers' queue and its count of claims held.
type lane struct {
	kind        string
	sender      Sender
	concurrency int
	capacity    int
	queue       chan *claimed
	held        atomic.Int64 // claimed and not yet recorded
}

// claimed is an effect this Dispatcher holds a lease on.
type claimed struct {
	Delivery
	fence        int64
	maxAttempts  int
	prevInFlight bool          // the previous attempt's outcome is unknown
	lagAtClaim   time.Duration // due → claim, by the database's clock
	claimedAt    time.Time     // local time just before the claim statement ran
	lane         *lane
}

// outcome is what to record for a claim.
type outcome struct {
	c        *claimed
	state    string // pending, done or dead
	delay    time.Duration
	inFlight bool // the outcome is unknown: reconcile before the next attempt
	undo     int  // 1: released without an attempt; give the attempt back
	err      string
	label    string // attempts_total outcome label
}

// NewDispatcher checks cfg and returns a Dispatcher. Call Run to start it.
func NewDispatcher(cfg Config) (*Dispatcher, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, fmt.Errorf("register metrics: %w", err)
	}
	d := &Dispatcher{
		cfg:    cfg,
		pool:   cfg.Pool,
		q:      newQueries(cfg.Schema, cfg.BatchSize*len(cfg.Senders)),
		log:    cfg.Logger,
		m:      m,
		byKind: map[string]*lane{},
		wake:   make(chan struct{}, 1),
		freed:  make(chan struct{}, 1),
	}
	for kind, s := range cfg.Senders {
		n := cmp.Or(cfg.Concurrency[kind], DefaultConcurrency)
		capacity := n + min(n, cfg.BatchSize)
		l := &lane{kind: kind, sender: s, concurrency: n, capacity: capacity, queue: make(chan *claimed, capacity)}
		d.lanes = append(d.lanes, l)
		d.byKind[kind] = l
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

	// Sends outlive ctx by up to ShutdownTimeout, so they get a context of their own.
	d.outcomes = make(chan outcome, 4*d.cfg.BatchSize)
	sendCtx, cancelSends := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelSends()

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
			workers.Go(func() { d.work(ctx, sendCtx, l) })
		}
	}
	d.log.Info("effects dispatcher started", "schema", d.cfg.Schema, "kinds", d.kinds())

	d.claimLoop(ctx)

	// Shutdown. The claim loop has stopped; workers finish their current send.
	done := make(chan struct{})
	go func() { workers.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(d.cfg.ShutdownTimeout):
		d.log.Warn("effects dispatcher: sends still running at the shutdown deadline; cancelling them")
		cancelSends()
		<-done
	}
	released := 0
	for _, l := range d.lanes {
		for len(l.queue) > 0 {
			d.outcomes <- d.release(<-l.queue)
			released++
		}
	}
	close(d.outcomes)
	<-recorded
	background.Wait()
	d.log.Info("effects dispatcher stopped", "schema", d.cfg.Schema, "released", released)
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

// claim runs the claim statement. It runs on a context that ctx's end does not
// cancel: a claim cut off after its commit would leave rows leased that nobody
// sends until the lease runs out.
func (d *Dispatcher) claim(ctx context.Context, kinds []string, limits []int32) ([]*claimed, error) {
	qctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	start := time.Now()
	// The claim runs in a transaction of its own that forbids sequential scans and
	// hash joins, sent as one pipelined round trip. Without that, statistics taken
	// while the table was small (before a burst of effects, until autovacuum
	// analyzes it again) make the planner scan the whole table on every claim:
	// measured here, 5k effects/s instead of 25k with 40,000 pending.
	b := &pgx.Batch{}
	b.Queue("BEGIN")
	b.Queue("SET LOCAL enable_seqscan = off")
	b.Queue("SET LOCAL enable_hashjoin = off")
	b.Queue(d.q.claim, kinds, limits, d.cfg.Lease)
	b.Queue("COMMIT")
	br := d.pool.SendBatch(qctx, b)
	defer br.Close()
	for range 3 {
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
		err := rows.Scan(&c.Kind, &c.Key, &c.Payload, &c.Attempt, &c.maxAttempts, &c.fence,
			&c.prevInFlight, &c.CreatedAt, &lag, &c.Source.Consumer, &c.Source.Tenant, &c.Source.Key)
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
	return out, nil
}

// work sends the effects of one lane until ctx ends. A claim taken from the queue
// after that is released unsent.
func (d *Dispatcher) work(ctx, sendCtx context.Context, l *lane) {
	for {
		select {
		case <-ctx.Done():
			return
		case c := <-l.queue:
			if ctx.Err() != nil {
				d.outcomes <- d.release(c)
				return
			}
			d.outcomes <- d.attempt(sendCtx, c)
		}
	}
}

// attempt carries out one claim and says what to record.
func (d *Dispatcher) attempt(ctx context.Context, c *claimed) outcome {
	lease := d.cfg.Lease
	deadline := c.claimedAt.Add(lease - lease/10)
	if time.Until(deadline) < lease/4 {
		// The claim waited in the queue for most of its lease. Sending now could
		// overlap another dispatcher's claim of the same effect once the lease ends.
		return d.release(c)
	}
	shutdown := ctx
	ctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	log := d.log.With("kind", c.Kind, "effect_key", c.Key, "attempt", c.Attempt)

	if c.prevInFlight {
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
		return d.dead(c, errors.New("attempts exhausted; the outcome of the last attempt is unknown"), c.prevInFlight, log)
	}

	d.m.lag.WithLabelValues(c.Kind).Observe((c.lagAtClaim + time.Since(c.claimedAt)).Seconds())
	err := sendSafely(ctx, c.lane.sender, c.Delivery)
	if err == nil {
		return outcome{c: c, state: "done", label: "done"}
	}
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
	return outcome{c: c, state: "pending", delay: delay, inFlight: indefinite, err: truncate(err.Error()), label: "retry"}
}

func (d *Dispatcher) dead(c *claimed, err error, inFlight bool, log *slog.Logger) outcome {
	log.Error("effect dead", "error", err)
	return outcome{c: c, state: "dead", inFlight: inFlight, err: truncate(err.Error()), label: "dead"}
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

func truncate(s string) string {
	if len(s) <= maxErrorLen {
		return s
	}
	return strings.ToValidUTF8(s[:maxErrorLen], "") + "…"
}

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
		}
		select {
		case d.freed <- struct{}{}:
		default:
		}
	}
}

func (d *Dispatcher) recordBatch(batch []outcome) {
	slices.SortFunc(batch, func(a, b outcome) int {
		return cmp.Or(strings.Compare(a.c.Kind, b.c.Kind), strings.Compare(a.c.Key, b.c.Key))
	})
	n := len(batch)
	kinds, keys, states, errs := make([]string, n), make([]string, n), make([]string, n), make([]*string, n)
	fences, delays := make([]int64, n), make([]int64, n)
	inFlight, undo := make([]bool, n), make([]int32, n)
	notify := false
	var soonest time.Duration = -1
	for i, o := range batch {
		kinds[i], keys[i], fences[i], states[i] = o.c.Kind, o.c.Key, o.c.fence, o.state
		delays[i], inFlight[i], undo[i] = o.delay.Milliseconds(), o.inFlight, int32(o.undo)
		if o.err != "" {
			errs[i] = &o.err
		}
		if o.state == "pending" {
			if o.delay == 0 {
				notify = true
			} else if soonest < 0 || o.delay < soonest {
				soonest = o.delay
			}
		}
	}
	applied := map[[2]string]bool{}
	err := retry(func(ctx context.Context) error {
		clear(applied)
		// One round trip: the outcome commits without waiting for its WAL flush.
		// That is safe here, and only here: if the server crashes and loses this
		// commit, each row goes back to the claim before it, which is durable and
		// in_flight, so the effect is reconciled or sent again after its lease. The
		// claim itself always commits synchronously.
		b := &pgx.Batch{}
		b.Queue(`BEGIN`)
		b.Queue(`SET LOCAL synchronous_commit = off`)
		b.Queue(d.q.record, kinds, keys, fences, states, delays, inFlight, undo, errs).Query(func(rows pgx.Rows) error {
			var k [2]string
			_, err := pgx.ForEachRow(rows, []any{&k[0], &k[1]}, func() error { applied[k] = true; return nil })
			return err
		})
		b.Queue(`COMMIT`)
		return d.pool.SendBatch(ctx, b).Close()
	})
	if err != nil {
		// The leases will run out and the effects will be claimed again: nothing is
		// lost, though a sent effect will be sent once more.
		d.log.Error("effects dispatcher: recording outcomes failed; the effects will be retried after their lease", "error", err, "outcomes", n)
		return
	}
	for _, o := range batch {
		if !applied[[2]string{o.c.Kind, o.c.Key}] {
			d.m.lostLease.WithLabelValues(o.c.Kind).Inc()
			d.log.Warn("effect lease lost: it was claimed again before this attempt's outcome was recorded",
				"kind", o.c.Kind, "effect_key", o.c.Key, "attempt", o.c.Attempt, "outcome", o.label)
			continue
		}
		d.m.attempts.WithLabelValues(o.c.Kind, o.label).Inc()
		if o.state == "dead" {
			d.m.dead.WithLabelValues(o.c.Kind).Inc()
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

func (d *Dispatcher) signalWake() {
	select {
	case d.wake <- struct{}{}:
	default:
	}
}

// retry runs f up to three times, each with its own timeout, for writes that must
// happen even while Run's context is ending.
func retry(f func(ctx context.Context) error) error {
	var err error
	for i := range 3 {
		if i > 0 {
			time.Sleep(time.Duration(i) * 200 * time.Millisecond)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err = f(ctx)
		cancel()
		if err == nil {
			return nil
		}
	}
	return err
}

// listen wakes the claim loop on each notification for this schema. It holds one
// connection of its own, outside the pool, and reconnects when it drops; after a
// reconnect it wakes the loop once, for notifications missed meanwhile.
func (d *Dispatcher) listen(ctx context.Context) {
	wait := 100 * time.Millisecond
	for ctx.Err() == nil {
		err := d.listenOnce(ctx)
		if ctx.Err() != nil {
			return
		}
		d.log.Warn("effects dispatcher: LISTEN connection lost; polling until it is back", "error", err, "retry_in", wait)
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		wait = min(2*wait, 5*time.Second)
	}
}

func (d *Dispatcher) listenOnce(ctx context.Context) error {
	conn, err := pgx.ConnectConfig(ctx, d.pool.Config().ConnConfig)
	if err != nil {
		return err
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = conn.Close(cctx)
	}()
	if _, err := conn.Exec(ctx, "LISTEN "+notifyChannel); err != nil {
		return err
	}
	d.signalWake()
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return err
		}
		if n.Payload == d.cfg.Schema {
			d.signalWake()
		}
	}
}

// pendingRefresh is how often idem_effects_pending is counted.
const pendingRefresh = 10 * time.Second

func (d *Dispatcher) refreshPendingLoop(ctx context.Context) {
	t := time.NewTicker(pendingRefresh)
	defer t.Stop()
	for {
		d.refreshPending(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// refreshPending sets idem_effects_pending for every kind that has pending
// effects, and for this Dispatcher's kinds (0 when none).
func (d *Dispatcher) refreshPending(ctx context.Context) {
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
	for _, l := range d.lanes {
		d.m.pending.WithLabelValues(l.kind).Set(counts[l.kind])
	}
	for k, v := range counts {
		d.m.pending.WithLabelValues(k).Set(v)
	}
}
