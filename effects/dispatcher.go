package effects

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/internal/citusmode"
	"github.com/idemkit/idem/internal/fanout"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/schemacheck"
	"github.com/idemkit/idem/internal/tracing"
	"github.com/idemkit/idem/shard"
)

// maxErrorLen caps the last_error stored for an effect.
const maxErrorLen = 2000

// Dispatcher claims due effects and carries them out with their kind's Sender.
// Any number of Dispatchers, in any number of processes, may serve one schema:
// claims skip rows that another holds, and fencing keeps a stale attempt from
// recording over a newer one. See the package documentation for the guarantees.
type Dispatcher struct {
	parts   *fanout.Set[*dispatcher]
	running atomic.Bool
}

// dispatcher is the Dispatcher of one database: one of a shard map's, or the only
// one. Each has its own claim loop, LISTEN connection and lanes.
type dispatcher struct {
	cfg    Config
	pool   *pgxpool.Pool
	q      queries
	log    *slog.Logger
	m      *metrics
	tracer trace.Tracer
	prop   propagation.TextMapPropagator
	lanes  []*lane // sorted by kind
	byKind map[string]*lane
	// dueTenants is dueTenantsSQL for the lanes' kinds; dueTenantsEachShard its
	// stand-in while a Citus worker is down.
	dueTenants, dueTenantsEachShard string
	// eachShard says the last round read the shards apart (findDueTenants).
	eachShard atomic.Bool

	wake     chan struct{} // a notification or a requeue: look for work now
	freed    chan struct{} // outcomes were recorded: capacity is free again
	outcomes chan outcome  // made by each Run, closed when it ends
	sendCtx  context.Context
	released atomic.Int64 // claims handed back unsent at shutdown, in this Run

	// citus: whether the schema is distributed by Citus, asked on the first
	// claim (settings).
	citus citusmode.Detector
}

// onCitus reports whether the schema is distributed by Citus
// (internal/citusmode), asking the database the first time; false while it
// cannot ask.
func (d *dispatcher) onCitus(ctx context.Context) bool {
	if on, known := d.citus.Known(); known {
		return on
	}
	on, err := d.citus.On(ctx, d.pool, pgschema.Table(d.cfg.Schema, "inbox"))
	return err == nil && on
}

// settings are the SET LOCAL statements of a claim's or an outcome write's
// transaction (claimSettings, recordSettings, or their Citus forms, citusSettings,
// on a schema distributed by Citus).
func (d *dispatcher) settings(ctx context.Context, plain []string) []string {
	if d.onCitus(ctx) {
		return citusSettings(plain)
	}
	return plain
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
	if err := schemacheck.Start(cfg.SkipSchemaCheck, cfg.Logger, fanout.SchemaTargets(cfg.Shards, cfg.Pool, cfg.Schema)); err != nil {
		return nil, err
	}
	parts, err := fanout.Build(cfg.Shards, cfg, cfg.forShard, newDispatcher)
	if err != nil {
		return nil, err
	}
	return &Dispatcher{parts: parts}, nil
}

// forShard returns c for sh's part of a Dispatcher: sh's database, and c's logger
// and registerer labelled with sh's name.
func (c Config) forShard(sh shard.Shard) Config {
	c.Shards, c.Pool, c.Schema = nil, sh.Pool, sh.SchemaName()
	c.SkipSchemaCheck = true // NewDispatcher checked every shard
	c.Logger, c.Registerer = fanout.Label(sh, c.Logger, c.Registerer)
	return c
}

func newDispatcher(cfg Config) (*dispatcher, error) {
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, fmt.Errorf("register metrics: %w", err)
	}
	d := &dispatcher{
		cfg:        cfg,
		pool:       cfg.Pool,
		q:          newQueries(cfg.Schema, cfg.BatchSize*len(cfg.Senders), cfg.Tenant != ""),
		log:        cfg.Logger,
		m:          m,
		tracer:     tracing.Tracer(cfg.TracerProvider),
		prop:       tracing.Propagator(cfg.Propagator),
		byKind:     map[string]*lane{},
		wake:       make(chan struct{}, 1),
		freed:      make(chan struct{}, 1),
		dueTenants: dueTenantsSQL(cfg.Schema, len(cfg.Senders)),

		dueTenantsEachShard: dueTenantsEachShardSQL(cfg.Schema),
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
// shutdown. Over a shard map every shard has its own claim loop, LISTEN
// connection (reconnected with backoff while its poll goes on) and lanes
// (Concurrency is per shard): a shard that is down does not stop the others.
func (d *Dispatcher) Run(ctx context.Context) error {
	if !d.running.CompareAndSwap(false, true) {
		return ErrDispatcherRunning
	}
	defer d.running.Store(false)
	return d.parts.Parallel(func(_ int, p *dispatcher) error { return p.run(ctx) })
}

func (d *dispatcher) run(ctx context.Context) error {
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

func (d *dispatcher) kinds() []string {
	ks := make([]string, len(d.lanes))
	for i, l := range d.lanes {
		ks[i] = l.kind
	}
	return ks
}

// claimLoop claims effects while ctx lasts, as many as each kind has room for. It
// claims again at once while claims come back full, and otherwise sleeps until a
// notification, the poll interval, or (when a kind is full) recorded outcomes.
func (d *dispatcher) claimLoop(ctx context.Context) {
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
//
// On Citus a Dispatcher without a Tenant cannot lock rows across shards, so it
// claims tenant by tenant: see claimEachTenant.
func (d *dispatcher) claim(ctx context.Context, kinds []string, limits []int32) ([]*claimed, error) {
	qctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	if d.cfg.Tenant == "" && d.onCitus(qctx) {
		return d.claimEachTenant(qctx, kinds, limits)
	}
	return d.claimTenant(qctx, kinds, limits, d.cfg.Tenant)
}

// claimEachTenant is the claim on Citus of a Dispatcher without a Tenant. One
// read without locks (dueTenantsSQL, run on every shard) names the tenants of
// the oldest due effects of each kind; then each of those tenants is claimed with the one-tenant
// claim, which Citus routes to the tenant's shard, while the kinds have room.
// Each round costs one read plus one claim per tenant with due work, and a
// claim per tenant takes at least one effect unless another Dispatcher took
// them first: tenants with nothing due cost nothing.
func (d *dispatcher) claimEachTenant(ctx context.Context, kinds []string, limits []int32) ([]*claimed, error) {
	left := slices.Clone(limits)
	index := make(map[string]int, len(kinds))
	for i, k := range kinds {
		index[k] = i
	}
	// dueTenants takes every lane's kind, in order, with no room for a kind not
	// claimed now.
	allKinds, room := make([]string, len(d.lanes)), make([]int32, len(d.lanes))
	for i, l := range d.lanes {
		allKinds[i] = l.kind
		if j, ok := index[l.kind]; ok {
			room[i] = limits[j]
		}
	}
	tenants, err := d.findDueTenants(ctx, allKinds, room)
	if err != nil {
		return nil, err
	}
	var out []*claimed
	var lastErr error
	seen := map[string]bool{}
	for _, tenant := range tenants {
		if seen[tenant] {
			continue
		}
		seen[tenant] = true
		var ks []string
		var ns []int32
		for i, k := range kinds {
			if left[i] > 0 {
				ks, ns = append(ks, k), append(ns, left[i])
			}
		}
		if len(ks) == 0 {
			break
		}
		got, err := d.claimTenant(ctx, ks, ns, tenant)
		if err != nil {
			// One tenant's shard failing (its worker down) does not hold back the
			// others' claims; the loop retries it with backoff if nothing was
			// claimed.
			lastErr = err
			d.log.Error("effects dispatcher: claim failed", "tenant", tenant, "error", err)
			continue
		}
		for _, c := range got {
			left[index[c.Kind]]--
		}
		out = append(out, got...)
	}
	if len(out) == 0 && lastErr != nil {
		return nil, lastErr
	}
	return out, nil
}

// findDueTenants names the tenants with due effects for claimEachTenant: the read
// of every shard (dueTenants), or, when it fails, the read of each shard apart
// (dueTenantsEachShard), so that while a worker is down the tenants of the others
// are still found and sent. It fails only when both reads fail.
func (d *dispatcher) findDueTenants(ctx context.Context, kinds []string, room []int32) ([]string, error) {
	rows, err := d.pool.Query(ctx, d.dueTenants, kinds, room)
	if err == nil {
		var tenants []string
		if tenants, err = pgx.CollectRows(rows, pgx.RowTo[string]); err == nil {
			if d.eachShard.CompareAndSwap(true, false) {
				d.log.Info("effects dispatcher: the read of due tenants on every shard answers again")
			}
			return tenants, nil
		}
	}
	var ks []string
	var n int32
	for i, k := range kinds {
		if room[i] > 0 {
			ks, n = append(ks, k), max(n, room[i])
		}
	}
	rows, err2 := d.pool.Query(ctx, d.dueTenantsEachShard, pgschema.Table(d.cfg.Schema, "effects"), ks, n)
	if err2 != nil {
		return nil, err
	}
	results, err2 := pgx.CollectRows(rows, pgx.RowTo[[]byte])
	if err2 != nil {
		return nil, err
	}
	var tenants []string
	for _, r := range results {
		var ts []string
		if json.Unmarshal(r, &ts) == nil {
			tenants = append(tenants, ts...)
		}
	}
	if d.eachShard.CompareAndSwap(false, true) { // once an outage, not every round
		d.log.Warn("effects dispatcher: the read of due tenants on every shard failed (a Citus worker down?); reading the shards that answer instead until it works again",
			"tenants", len(tenants), "error", err)
	}
	return tenants, nil
}

// claimTenant runs the claim statement: of tenant's effects with a Dispatcher's
// Tenant, or on Citus (a tenant claimEachTenant found, "" the unscoped one); of
// every tenant's otherwise.
func (d *dispatcher) claimTenant(qctx context.Context, kinds []string, limits []int32, tenant string) ([]*claimed, error) {
	start := time.Now()
	// The claim runs in a transaction of its own, with the settings that fix its
	// plan (see claimSettings), sent as one pipelined round trip.
	b := &pgx.Batch{}
	b.Queue(beginSQL)
	settings, claimSQL, oneTenant := claimSettings, d.q.claim, d.cfg.Tenant != ""
	if d.onCitus(qctx) {
		settings, claimSQL, oneTenant = citusSettings(claimSettings), d.q.claimCitus, true
	}
	for _, s := range settings {
		b.Queue(s)
	}
	args := []any{kinds, limits, d.cfg.Lease}
	if oneTenant {
		args = append(args, tenant)
	}
	b.Queue(claimSQL, args...)
	b.Queue("COMMIT")
	br := d.pool.SendBatch(qctx, b)
	defer func() { _ = br.Close() }() // every result is read below; Close releases the connection
	for range 1 + len(settings) {
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
			&c.prevInFlight, &c.CreatedAt, &lag, &c.SourceConsumer, &c.SourceTenant, &c.SourceKey, &c.trace)
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
