// Package benchkit drives one workload under several setups side by side, for
// `idem bench` and the `go test -bench` benchmarks: a bare handler with its own
// transaction, idem per message, idem with (set-based) group commit, idem with a
// batch handler, and Watermill's in-memory Deduplicator. The broker is Watermill's GoChannel with one topic per "partition";
// a message and its duplicates go to the partition of their key, as in Kafka, and
// partitions are handled concurrently. The Kafka setups run the batch handler over
// a real Kafka topic (kfake in process, or the brokers given) through
// adapters/kafka, from produce to offset commit.
package benchkit

import (
	"cmp"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	mrand "math/rand/v2"
	"runtime"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/redact"
)

// Setup names a way of handling the workload.
type Setup string

// The setups.
const (
	Bare         Setup = "bare"         // (a) own transaction, no dedupe
	PerMessage   Setup = "idem"         // (b) idem, one transaction per message
	GroupCommit  Setup = "idem-group"   // (c) idem, set-based group commit, the same per-message handler
	Deduplicator Setup = "deduplicator" // (d) Watermill's middleware.Deduplicator + bare handler
	Drain        Setup = "dispatcher"   // (f) the effects Dispatcher draining what the others enqueued
	// (e) idem, a batch handler (consumer.HandleBatch): one INSERT … SELECT FROM
	// unnest for the batch's business rows, its effects in one statement. It runs
	// on BatchPartitions partitions, since a batch is only as large as the messages
	// in flight.
	Batch Setup = "idem-batch"
	// (g) the batch handler of (e) over Kafka: records produced with
	// adapters/kafka's Publisher to a topic of KafkaPartitions partitions on an
	// in-process kfake broker, read by adapters/kafka's Subscriber with
	// MaxInFlightPerPartition KafkaInFlight, measured from produce to the group's
	// offset commit.
	Kafka Setup = "kafka"
	// (h) the same on the real brokers of KafkaBrokers.
	KafkaExternal Setup = "kafka-external"
)

// AllSetups is the order the setups run in. The Dispatcher comes last: it drains
// what the others enqueued.
var AllSetups = []Setup{Bare, PerMessage, GroupCommit, Deduplicator, Batch, Kafka, KafkaExternal, Drain}

// Options describe the workload.
type Options struct {
	// DatabaseURL is the Postgres to run against. Each run opens its own pool, with
	// a tracer that counts COMMITs exactly.
	DatabaseURL string
	Schema      string // migrated idem schema; the business table is made in it
	MaxConns    int32  // pool size (default Concurrency + 4)
	// N unique messages; DupRate of them are delivered twice.
	N           int
	DupRate     float64
	Concurrency int // partitions handled at once (default 16)
	PayloadSize int // bytes (default 128)
	Seed        uint64
	// Progress, if set, is called about every 1% with deliveries handled so far and
	// the deliveries expected in all.
	Progress func(done, total int)
	// MaxBatch and MaxWait tune group commit (consumer defaults if 0).
	MaxBatch int
	MaxWait  time.Duration
	Workers  int
	// DrainBacklog is the fewest pending effects the Drain setup drains: it adds
	// effects of its own (as Enqueue writes them) to what the other setups left, up
	// to this many. idem bench asks for 100,000.
	DrainBacklog int
	// BatchPartitions is the partitions of the Batch setup (default
	// DefaultBatchPartitions), and BatchMaxBatch its batch size (default
	// DefaultBatchMaxBatch). Its pool has Workers + 4 connections.
	BatchPartitions int
	BatchMaxBatch   int

	// KafkaBrokers are the brokers of the KafkaExternal setup. A Kafka setup
	// makes one topic and one consumer group, named TopicPrefix, a random run id
	// and the setup, and deletes both at the end; it touches nothing else.
	KafkaBrokers []string
	// KafkaPartitions is the partitions of a Kafka setup's topic (default
	// DefaultKafkaPartitions), and KafkaInFlight its subscriber's
	// MaxInFlightPerPartition (default DefaultKafkaInFlight), and KafkaMaxBatch
	// the batch handler's batch size (default DefaultKafkaMaxBatch).
	KafkaPartitions int
	KafkaInFlight   int
	KafkaMaxBatch   int
	// KafkaProducers goroutines publish KafkaChunk records a call (defaults
	// DefaultKafkaProducers, DefaultKafkaChunk), keeping at most KafkaWindow
	// records produced and not yet handled (default the records the subscriber
	// may have in flight, KafkaPartitions × KafkaInFlight).
	KafkaProducers int
	KafkaChunk     int
	KafkaWindow    int
	// KafkaMinBytes and KafkaFetchWait are the subscriber's fetch MinBytes and
	// MaxWait (adapters/kafka's defaults if 0): a fetch waits up to
	// KafkaFetchWait for KafkaMinBytes of records.
	KafkaMinBytes  int
	KafkaFetchWait time.Duration

	// ProfileDir, when set, receives a CPU profile and allocation profiles of
	// each setup's timed part: <setup>.cpu.pprof, and <setup>.allocs-start.pprof
	// and <setup>.allocs.pprof, whose difference is the run's allocations
	// (go tool pprof -sample_index=alloc_space -diff_base <setup>.allocs-start.pprof <setup>.allocs.pprof).
	ProfileDir string

	pool *pgxpool.Pool
}

// Result is one setup's figures.
type Result struct {
	Setup         Setup         `json:"setup"`
	Messages      int           `json:"messages"`
	Deliveries    int           `json:"deliveries"`
	Elapsed       time.Duration `json:"elapsed_ns"`
	MsgsPerSec    float64       `json:"msgs_per_sec"` // deliveries per second
	P50           time.Duration `json:"p50_ns"`
	P99           time.Duration `json:"p99_ns"`
	CommitsPerMsg float64       `json:"commits_per_msg"`     // Postgres COMMITs per delivery (per effect for Drain)
	TripsPerMsg   float64       `json:"round_trips_per_msg"` // queries and batches sent to Postgres, likewise
	BusinessRows  int           `json:"business_rows"`
	// CommittedTwice is business rows beyond one per message; Lost is messages
	// with no business row.
	CommittedTwice int    `json:"committed_twice"`
	Lost           int    `json:"lost"`
	PeakHeapBytes  uint64 `json:"peak_heap_bytes"`
	// CPU is the run's cost per delivery (per effect for the Dispatcher): CPU
	// time of this process and of the run's Postgres backends, and allocations.
	CPU CPU `json:"per_delivery"`
	// Broker is the broker a Kafka setup ran on, and Topic the topic and consumer
	// group it made (and deleted).
	Broker string `json:"broker,omitempty"`
	Topic  string `json:"topic,omitempty"`
}

// Defaults of the Batch setup.
const (
	DefaultBatchPartitions = 256
	DefaultBatchMaxBatch   = 256
)

func (o *Options) defaults() {
	o.Concurrency = cmp.Or(o.Concurrency, 16)
	o.PayloadSize = cmp.Or(o.PayloadSize, 128)
	o.BatchPartitions = cmp.Or(o.BatchPartitions, DefaultBatchPartitions)
	o.BatchMaxBatch = cmp.Or(o.BatchMaxBatch, DefaultBatchMaxBatch)
	o.kafkaDefaults()
}

// Prepare empties the schema's idem tables and the business table, before a series
// of runs. The caller owns the schema: Prepare empties whatever schema it is given
// (idem bench hands it only a scratch schema of its own, package scratch).
// Errors never show the database password.
func Prepare(ctx context.Context, o Options) (err error) {
	defer func() { err = redact.Error(err, o.DatabaseURL) }()
	o.defaults()
	pool, err := openPool(ctx, o, &commitCounter{})
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := reset(ctx, pool, o.Schema); err != nil {
		return err
	}
	effectsTable := pgx.Identifier{o.Schema, "effects"}.Sanitize()
	if _, err = pool.Exec(ctx, `TRUNCATE `+effectsTable); err != nil {
		return err
	}
	// The Drain setup measures the Dispatcher on a burst of effects in a table
	// that was never analyzed, which is when its plans depend on statistics if
	// anything does: autovacuum must not analyze the table meanwhile.
	_, err = pool.Exec(ctx, `ALTER TABLE `+effectsTable+` SET (autovacuum_enabled = off)`)
	return err
}

// Run drives the workload once under setup. It empties the business table and the
// inbox first; effects stay, for the Drain setup. Errors never show the database
// password.
func Run(ctx context.Context, setup Setup, o Options) (res Result, err error) {
	defer func() { err = redact.Error(err, o.DatabaseURL) }()
	o.defaults()
	if setup == Drain {
		return runDrain(ctx, o)
	}
	if o.N <= 0 {
		return Result{}, errors.New("benchkit: N must be positive")
	}
	if setup == Kafka || setup == KafkaExternal {
		return runKafka(ctx, setup, o)
	}
	if setup == Batch {
		o.Concurrency = o.BatchPartitions
		o.batchConns()
	}
	counter, handler, closeFn, err := open(ctx, setup, &o)
	if err != nil {
		return Result{}, err
	}
	defer closeFn()
	pool := o.pool

	commitsBefore, tripsBefore := counter.n.Load(), counter.trips.Load()

	// Publish blocks until the subscriber acks, and each partition has one
	// publishing goroutine: so each partition has one message in flight, as a Kafka
	// partition does, and concurrency is exactly the number of partitions.
	pubsub := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	defer func() { _ = pubsub.Close() }() // after the router: nothing is in flight
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		return Result{}, err
	}

	hist := newHistogram()
	var handled atomic.Int64
	// The outermost middleware times every delivery and counts it once it is acked.
	measure := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			start := time.Now()
			out, err := h(msg)
			if err == nil {
				hist.observe(time.Since(start))
				handled.Add(1)
			}
			return out, err
		}
	}
	for p := range o.Concurrency {
		name := fmt.Sprintf("bench-%d", p)
		h := router.AddConsumerHandler(name, name, pubsub, handler)
		h.AddMiddleware(measure)
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(runCtx) }()
	select {
	case <-router.Running():
	case err := <-routerDone:
		return Result{}, fmt.Errorf("router: %w", err)
	}

	// Produce lazily, so memory stays flat however large N is.
	rng := mrand.New(mrand.NewPCG(o.Seed, 42))
	payload := make([]byte, o.PayloadSize)
	_, _ = rand.Read(payload)
	parts := make([]chan *message.Message, o.Concurrency)
	var pubErr error
	var pubErrOnce sync.Once
	var pubs sync.WaitGroup
	for p := range parts {
		parts[p] = make(chan *message.Message, 64)
		topic := fmt.Sprintf("bench-%d", p)
		pubs.Go(func() {
			for m := range parts[p] {
				if err := pubsub.Publish(topic, m); err != nil {
					pubErrOnce.Do(func() { pubErr = err })
				}
			}
		})
	}
	total := 0
	// The expected deliveries, for progress; the exact count is known at the end.
	expected := int(float64(o.N) * (1 + o.DupRate))
	var peak uint64
	var ms runtime.MemStats
	m, err := startMeter(ctx, o, setup, pool)
	if err != nil {
		return Result{}, err
	}
	defer m.close()
	start := time.Now()
	step := max(o.N/100, 1)
	for i := range o.N {
		copies := 1
		if rng.Float64() < o.DupRate {
			copies = 2
		}
		id := consumer.NewUUID()
		part := parts[partition(id, o.Concurrency)]
		for range copies {
			part <- message.NewMessage(id, payload)
			total++
		}
		if i%step == 0 {
			if o.Progress != nil {
				o.Progress(int(handled.Load()), max(expected, total))
			}
			runtime.ReadMemStats(&ms)
			peak = max(peak, ms.HeapInuse)
		}
	}
	for _, p := range parts {
		close(p)
	}
	waitPubs := make(chan struct{})
	go func() { pubs.Wait(); close(waitPubs) }()
	select {
	case <-waitPubs:
	case err := <-routerDone:
		return Result{}, fmt.Errorf("router stopped: %v", err)
	}
	if pubErr != nil {
		return Result{}, pubErr
	}
	for handled.Load() < int64(total) {
		time.Sleep(time.Millisecond)
	}
	elapsed := time.Since(start)
	cpu, err := m.stop(ctx, total)
	if err != nil {
		return Result{}, err
	}
	if o.Progress != nil {
		o.Progress(total, total)
	}
	cancel()
	if err := <-routerDone; err != nil {
		return Result{}, fmt.Errorf("router: %w", err)
	}

	res = Result{Setup: setup, Messages: o.N, Deliveries: total, Elapsed: elapsed,
		MsgsPerSec: float64(total) / elapsed.Seconds(), P50: hist.quantile(0.5), P99: hist.quantile(0.99),
		PeakHeapBytes: peak, CPU: cpu}
	res.CommitsPerMsg = float64(counter.n.Load()-commitsBefore) / float64(total)
	res.TripsPerMsg = float64(counter.trips.Load()-tripsBefore) / float64(total)
	if err := countBusiness(ctx, pool, o, &res); err != nil {
		return Result{}, err
	}
	return res, nil
}

// batchConns sizes the pool of a batch-handler setup: one connection for each
// batch at once, and a few for the rest.
func (o *Options) batchConns() {
	o.MaxConns = cmp.Or(o.MaxConns, int32(cmp.Or(o.Workers, consumer.DefaultWorkers))+4)
}

// open readies a run of setup: a pool (o.pool) that counts commits and round
// trips, the business table and the inbox emptied, and the setup's handler.
// closeFn closes the handler and the pool.
func open(ctx context.Context, setup Setup, o *Options) (counter *commitCounter, handler message.NoPublishHandlerFunc, closeFn func(), err error) {
	counter = &commitCounter{}
	pool, err := openPool(ctx, *o, counter)
	if err != nil {
		return nil, nil, nil, err
	}
	if err := reset(ctx, pool, o.Schema); err != nil {
		pool.Close()
		return nil, nil, nil, err
	}
	o.pool = pool
	handler, closeHandler, err := build(setup, *o)
	if err != nil {
		pool.Close()
		return nil, nil, nil, err
	}
	return counter, handler, func() { closeHandler(); pool.Close() }, nil
}

// countBusiness fills in the business rows, the messages committed twice and the
// messages lost.
func countBusiness(ctx context.Context, pool *pgxpool.Pool, o Options, res *Result) error {
	t := pgx.Identifier{o.Schema, "bench_biz"}.Sanitize()
	var distinct int
	if err := pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT key) FROM `+t).Scan(&res.BusinessRows, &distinct); err != nil {
		return err
	}
	res.CommittedTwice = res.BusinessRows - distinct
	res.Lost = o.N - distinct
	return nil
}

func partition(key string, n int) int {
	h := fnv.New32a()
	_, _ = h.Write([]byte(key))
	return int(h.Sum32() % uint32(n))
}

func reset(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	s := pgx.Identifier{schema}.Sanitize()
	_, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+s+`.bench_biz (id bigserial PRIMARY KEY, key text NOT NULL, payload bytea);
		TRUNCATE `+s+`.bench_biz, `+s+`.inbox`)
	return err
}

// commitCounter counts the COMMITs that succeed on the pool, and the round trips
// (each query, and each pipelined batch, is one): exact, whatever else runs on the
// database, so they compare setups even on a noisy machine.
type commitCounter struct{ n, trips atomic.Int64 }

func (c *commitCounter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	c.trips.Add(1)
	return ctx
}
func (c *commitCounter) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (c *commitCounter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

func (c *commitCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.trips.Add(1)
	return ctx
}

// TraceQueryEnd counts by the command tag, not the SQL text: idem's COMMIT travels
// with the check that its transaction is still its own ("SELECT …; COMMIT"), and a
// multi-statement query reports the tag of its last statement.
func (c *commitCounter) TraceQueryEnd(_ context.Context, _ *pgx.Conn, d pgx.TraceQueryEndData) {
	if d.Err == nil && d.CommandTag.String() == "COMMIT" {
		c.n.Add(1)
	}
}

func openPool(ctx context.Context, o Options, tracer pgx.QueryTracer) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(o.DatabaseURL)
	if err != nil {
		return nil, fmt.Errorf("database URL: %w", err)
	}
	cfg.MaxConns = cmp.Or(o.MaxConns, int32(o.Concurrency)+4)
	cfg.ConnConfig.Tracer = tracer
	// The run's own backends, whose CPU time the meter reads.
	cfg.ConnConfig.RuntimeParams["application_name"] = newAppName()
	return pgxpool.NewWithConfig(ctx, cfg)
}

// build returns the handler (with any middleware) for a setup.
func build(setup Setup, o Options) (message.NoPublishHandlerFunc, func(), error) {
	scope := effectsdb.Scope{Schema: o.Schema}
	biz := pgx.Identifier{o.Schema, "bench_biz"}.Sanitize()
	work := func(ctx context.Context, tx pgx.Tx, msg *message.Message, sc effectsdb.Scope) error {
		if _, err := tx.Exec(ctx, `INSERT INTO `+biz+` (key, payload) VALUES ($1, $2)`, msg.UUID, msg.Payload); err != nil {
			return err
		}
		_, err := effectsdb.Enqueue(ctx, tx, sc, effectsdb.Effect{Kind: "bench", Key: "fx:" + msg.UUID, Payload: msg.Payload})
		return err
	}
	bare := func(msg *message.Message) error {
		ctx := msg.Context()
		return pgx.BeginFunc(ctx, o.pool, func(tx pgx.Tx) error { return work(ctx, tx, msg, scope) })
	}
	switch setup {
	case Bare:
		return bare, func() {}, nil
	case Deduplicator:
		repo, err := middleware.NewMapExpiringKeyRepository(time.Hour)
		if err != nil {
			return nil, nil, err
		}
		d := &middleware.Deduplicator{
			KeyFactory: func(m *message.Message) (string, error) { return m.UUID, nil },
			Repository: repo,
		}
		h := d.Middleware(func(msg *message.Message) ([]*message.Message, error) { return nil, bare(msg) })
		return func(msg *message.Message) error { _, err := h(msg); return err }, func() {}, nil
	case PerMessage, GroupCommit:
		cfg := consumer.Config{Name: "bench", Pool: o.pool, Schema: o.Schema,
			Batch: consumer.BatchConfig{MaxBatch: o.MaxBatch, MaxWait: o.MaxWait, Workers: o.Workers}}
		if setup == GroupCommit {
			cfg.Mode = consumer.GroupCommit
		}
		c, err := consumer.New(cfg)
		if err != nil {
			return nil, nil, err
		}
		h := c.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			sc, _ := effectsdb.ScopeFrom(ctx)
			return nil, work(ctx, consumer.Tx(ctx), msg, sc)
		})
		return func(msg *message.Message) error { _, err := h(msg); return err }, func() { _ = c.Close() }, nil
	case Batch:
		c, err := consumer.New(consumer.Config{Name: "bench", Pool: o.pool, Schema: o.Schema,
			Batch: consumer.BatchConfig{MaxBatch: o.BatchMaxBatch, MaxWait: o.MaxWait, Workers: o.Workers}})
		if err != nil {
			return nil, nil, err
		}
		insert := `INSERT INTO ` + biz + ` (key, payload) SELECT * FROM unnest($1::text[], $2::bytea[])`
		h := c.HandleBatch(func(ctx context.Context, tx pgx.Tx, msgs []*message.Message) error {
			keys := make([]string, len(msgs))
			payloads := make([][]byte, len(msgs))
			for i, m := range msgs {
				keys[i], payloads[i] = m.UUID, m.Payload
				if _, err := effects.Enqueue(m.Context(), tx, effects.Effect{Kind: "bench", Key: "fx:" + m.UUID, Payload: m.Payload}); err != nil {
					return consumer.ForMessage(m, err)
				}
			}
			_, err := tx.Exec(ctx, insert, keys, payloads)
			return err
		})
		return h, func() { _ = c.Close() }, nil
	}
	return nil, nil, fmt.Errorf("benchkit: unknown setup %q", setup)
}

// runDrain runs a Dispatcher with a no-op sender until every pending "bench" effect
// is done. Latency is from the effect's commit to its send.
func runDrain(ctx context.Context, o Options) (Result, error) {
	counter := &commitCounter{}
	pool, err := openPool(ctx, o, counter)
	if err != nil {
		return Result{}, err
	}
	defer pool.Close()
	table := pgx.Identifier{o.Schema, "effects"}.Sanitize()
	var pending int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+table+` WHERE state = 'pending'`).Scan(&pending); err != nil {
		return Result{}, err
	}
	if more := o.DrainBacklog - pending; more > 0 {
		_, err := pool.Exec(ctx, `INSERT INTO `+table+` (kind, key, payload, fingerprint, source_consumer, source_tenant, source_key)
			SELECT 'bench', 'fx:drain-' || g, p, sha256(p), 'bench-drain', '', 'drain-' || g
			FROM generate_series(1, $1::int) g, (SELECT convert_to(repeat('x', $2::int), 'UTF8') AS p) AS payload`,
			more, o.PayloadSize)
		if err != nil {
			return Result{}, err
		}
		pending += more
	}
	if pending == 0 {
		return Result{}, errors.New("benchkit: no pending effects to drain; run the other setups first")
	}
	hist := newHistogram()
	var sent atomic.Int64
	// A no-op sender: claims of up to 1,000. The Dispatcher holds at most
	// Concurrency + min(Concurrency, BatchSize) claims of a kind, so with 2,000
	// sends at once a claim need not wait for the outcome write of the one before.
	d, err := effects.NewDispatcher(effects.Config{
		Pool: pool, Schema: o.Schema, BatchSize: 1000,
		Concurrency: map[string]int{"bench": 2000},
		Senders: map[string]effects.Sender{"bench": effects.SenderFunc(func(_ context.Context, dl effects.Delivery) error {
			hist.observe(time.Since(dl.CreatedAt))
			sent.Add(1)
			return nil
		})},
	})
	if err != nil {
		return Result{}, err
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	m, err := startMeter(ctx, o, Drain, pool)
	if err != nil {
		return Result{}, err
	}
	defer m.close()
	start := time.Now()
	before, tripsBefore := counter.n.Load(), counter.trips.Load()
	go func() { done <- d.Run(runCtx) }()
	// Watch the sender's own counter (a count(*) every few milliseconds would
	// compete with the dispatcher), and confirm the end with one query.
	for {
		n := int(sent.Load())
		if o.Progress != nil {
			o.Progress(min(n, pending), pending)
		}
		if n >= pending {
			var left int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+table+` WHERE state = 'pending'`).Scan(&left); err != nil {
				return Result{}, err
			}
			if left == 0 {
				break
			}
		}
		select {
		case err := <-done:
			return Result{}, fmt.Errorf("dispatcher stopped: %w", cmp.Or(err, ctx.Err()))
		case <-time.After(10 * time.Millisecond):
		}
	}
	elapsed := time.Since(start)
	cpu, err := m.stop(ctx, pending)
	if err != nil {
		return Result{}, err
	}
	cancel()
	if err := <-done; err != nil {
		return Result{}, fmt.Errorf("dispatcher: %w", err)
	}
	n := int(sent.Load())
	return Result{Setup: Drain, Messages: pending, Deliveries: n, Elapsed: elapsed,
		MsgsPerSec: float64(pending) / elapsed.Seconds(), P50: hist.quantile(0.5), P99: hist.quantile(0.99),
		CommitsPerMsg:  float64(counter.n.Load()-before) / float64(pending),
		TripsPerMsg:    float64(counter.trips.Load()-tripsBefore) / float64(pending),
		CommittedTwice: n - pending, CPU: cpu}, nil
}

// histogram keeps latencies in log-spaced buckets (about 2% wide), so memory is
// flat however many messages run.
type histogram struct {
	mu      sync.Mutex
	buckets [1200]int64
	n       int64
}

func newHistogram() *histogram { return &histogram{} }

const histBase = 1.02

func (h *histogram) observe(d time.Duration) {
	us := max(float64(d)/float64(time.Microsecond), 1)
	i := min(int(math.Log(us)/math.Log(histBase)), len(h.buckets)-1)
	h.mu.Lock()
	h.buckets[i]++
	h.n++
	h.mu.Unlock()
}

func (h *histogram) quantile(q float64) time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	target := int64(math.Ceil(q * float64(h.n)))
	var seen int64
	for i, c := range h.buckets {
		seen += c
		if seen >= target && c > 0 {
			return time.Duration(math.Pow(histBase, float64(i)+0.5) * float64(time.Microsecond))
		}
	}
	return 0
}

// Sorted returns results in AllSetups order.
func Sorted(rs []Result) []Result {
	order := map[Setup]int{}
	for i, s := range AllSetups {
		order[s] = i
	}
	sort.SliceStable(rs, func(i, j int) bool { return order[rs[i].Setup] < order[rs[j].Setup] })
	return rs
}
