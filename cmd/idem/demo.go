package main

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/pflag"

	"github.com/idemkit/idem/chaos"
	"github.com/idemkit/idem/cmd/idem/internal/payments"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/redact"
)

// demoSchema is the demo's own schema, dropped and made again on every run. The
// demo only drops a schema it made itself (package scratch), so it never touches
// the idem schema of a real deployment or any other schema of a user's.
const demoSchema = "idem_demo"

// demoWaitForPostgres is how long the demo waits for Postgres to accept
// connections before it says how to start one.
const demoWaitForPostgres = 15 * time.Second

var demoCmd = &command{
	name: "demo",
	args: "[-n N] [--broker nats|kafka] [--kafka-brokers H:P,...] [--seed S] [--json]",
	summary: "Show the guarantee under chaos: payments through a broker, with duplicates, " +
		"redeliveries, consumer restarts and cut database connections, then the audit",
	example: `idem demo                       # embedded NATS JetStream, 1000 payments
idem demo -n 5000 --seed 7
idem demo --broker kafka        # KAFKA_BROKERS if set, else an in-process Kafka-protocol broker
idem demo --broker kafka --kafka-brokers kafka1:9092,kafka2:9092
DATABASE_URL=postgres://postgres@db:5432/postgres?sslmode=disable idem demo --json

The demo works in a schema of its own, idem_demo, dropped and made again on
every run (--schema names another one; the default idem schema is never used).
It only drops a schema that it or idem bench created and marked; it refuses any
other (public included), and a schema another demo or bench is using right now.
Exit codes: 0 nothing lost and nothing committed twice, 1 otherwise (or the
schema is in use), 2 bad usage (a schema it refuses), 3 no Postgres.`,
	setup: func(fs *pflag.FlagSet) runFunc {
		var o demoOptions
		fs.IntVarP(&o.n, "n", "n", 1000, "payments to publish")
		fs.StringVar(&o.broker, "broker", payments.NATS, "nats (embedded JetStream) or kafka")
		fs.StringVar(&o.kafkaBrokers, "kafka-brokers", os.Getenv("KAFKA_BROKERS"),
			"with --broker kafka: Kafka brokers, comma-separated (default $KAFKA_BROKERS; empty: an in-process Kafka-protocol broker)")
		fs.Int64Var(&o.seed, "seed", 0, "seed of the chaos (0: from the clock)")
		return func(ctx context.Context, e *env, args []string) error {
			if err := noArgs(args); err != nil {
				return err
			}
			return runDemo(ctx, e, o)
		}
	},
}

type demoOptions struct {
	n            int
	broker       string
	kafkaBrokers string
	seed         int64
}

// demoJSON is the --json output.
type demoJSON struct {
	Broker        string `json:"broker"`
	BrokerAddress string `json:"broker_address"`
	// Topic is the run's own topic on a real Kafka broker (--kafka-brokers).
	Topic          string  `json:"topic,omitempty"`
	Schema         string  `json:"schema"`
	Seed           int64   `json:"seed"`
	ElapsedSeconds float64 `json:"elapsed_seconds"`
	Restarts       int64   `json:"consumer_restarts"`
	BackendCuts    int64   `json:"backend_cuts"`
	ProducerDups   int64   `json:"producer_duplicates"`
	Report         struct {
		Messages, CommittedOnce, CommittedTwice, Lost, Failed int
		Deliveries, DuplicatesSuppressed                      int64
		EffectsDone, EffectsDead, EffectsPending              int
		SendsTotal, SendsOnce, SendsRepeated, SendsMissing    int
	} `json:"report"`
	OK bool `json:"ok"`
}

// runDemo runs the demo's steps in order: check the flags, reach Postgres, claim
// and migrate the scratch schema, start the broker and the SMTP receiver, run the
// payments under chaos until the audit settles, and print the report.
func runDemo(ctx context.Context, e *env, o demoOptions) error {
	if err := o.check(); err != nil {
		return err
	}
	d := &demoRun{e: e, o: o, schema: demoSchemaOf(e)}
	if d.o.seed == 0 {
		d.o.seed = time.Now().UnixNano() % 1_000_000
	}
	db, err := waitForPostgres(ctx, e, d.say)
	if err != nil {
		return err // a connectError: exit code 3, as for every command
	}
	d.db = db
	claimed, err := claimScratch(ctx, e, db, d.schema, demoScratch)
	if err != nil {
		return err
	}
	defer claimed.Release()
	if err := payments.CreateTables(ctx, db, d.schema); err != nil {
		return err
	}
	if d.workers, err = payments.NewPool(ctx, e.databaseURL, payments.ApplicationName(d.schema), 8); err != nil {
		return err
	}
	defer d.workers.Close()
	stopBroker, err := d.startBroker(ctx)
	if err != nil {
		return err
	}
	defer stopBroker()
	if d.box, err = payments.StartMailbox("127.0.0.1:0"); err != nil {
		return err
	}
	defer func() { _ = d.box.Close() }()
	d.announce(claimed.Reset)
	rep, elapsed, err := d.run(ctx)
	if err != nil {
		return err
	}
	return d.report(rep, elapsed)
}

// check refuses flags the demo cannot run with.
func (o demoOptions) check() error {
	if o.n < 1 {
		return usagef("-n must be at least 1")
	}
	if o.broker != payments.NATS && o.broker != payments.Kafka {
		return usagef("--broker must be nats or kafka, got %q", o.broker)
	}
	return nil
}

// demoSchemaOf is the schema the demo works in: --schema when given, but never
// the default idem schema ($IDEM_SCHEMA names a real deployment's schema).
func demoSchemaOf(e *env) string {
	if e.schema == inbox.DefaultSchema || !e.schemaGiven {
		return demoSchema
	}
	return e.schema
}

// waitForPostgres connects, waiting up to demoWaitForPostgres for a server that
// refuses connections: right after "docker compose up -d" it may still be
// starting, and the quick start's two commands follow each other at once.
func waitForPostgres(ctx context.Context, e *env, say func(string, ...any)) (*pgxpool.Pool, error) {
	db, err := e.connect(ctx)
	var ce *connectError
	for waited := time.Duration(0); err != nil && errors.As(err, &ce) && waited < demoWaitForPostgres && ctx.Err() == nil; waited += 500 * time.Millisecond {
		if waited == 0 {
			say("idem demo: waiting up to %s for Postgres at %s ...", demoWaitForPostgres, ce.host)
		}
		time.Sleep(500 * time.Millisecond)
		db, err = e.connect(ctx)
	}
	return db, err
}

// demoRun is one run of the demo: its settings, what its steps start, and what
// they count.
type demoRun struct {
	e      *env
	o      demoOptions
	schema string

	db      *pgxpool.Pool // the CLI's: migration, audit, progress and cuts
	workers *pgxpool.Pool // the consumers' and the dispatchers'
	box     *payments.Mailbox

	ep          payments.Endpoint
	topic       string
	brokerDesc  string // for the first line and the summary
	sessionNote string // when a Kafka broker refuses 1 s sessions

	deliveries, suppressed, restarts, cuts, producerDups atomic.Int64

	// bar shows the run's progress; only the watch goroutine draws on it until
	// the run has stopped.
	bar *progress
}

// say writes a line of notes (stderr).
func (d *demoRun) say(format string, args ...any) { fmt.Fprintf(d.e.notes(), format+"\n", args...) }

// startBroker starts or reaches the broker of --broker and makes the run's
// topic; stop undoes what it started.
func (d *demoRun) startBroker(ctx context.Context) (stop func(), err error) {
	var undo []func()
	stop = func() {
		for _, f := range slices.Backward(undo) {
			f()
		}
	}
	defer func() {
		if err != nil {
			stop()
		}
	}()
	d.ep = payments.Endpoint{Broker: d.o.broker, Group: "payments-demo"}
	d.topic = payments.Topic
	switch {
	case d.o.broker == payments.NATS:
		dir, err := os.MkdirTemp("", "idem-demo-nats-")
		if err != nil {
			return stop, err
		}
		undo = append(undo, func() { _ = os.RemoveAll(dir) })
		srv, err := payments.StartNATS(dir, -1)
		if err != nil {
			return stop, err
		}
		undo = append(undo, func() { srv.Shutdown(); srv.WaitForShutdown() })
		d.ep.Addr = srv.ClientURL()
		d.brokerDesc = "embedded NATS JetStream at " + d.ep.Addr
	case d.o.kafkaBrokers != "":
		d.ep.Addr = d.o.kafkaBrokers
		// A topic and a group of their own per run: an earlier run's payments
		// stay in a real broker's topic and are not this run's, and a demo
		// running at the same time on another schema must not share them.
		d.topic = fmt.Sprintf("idem-demo-%s-%d", d.schema, time.Now().UnixNano())
		d.ep.Group = d.topic
		d.brokerDesc = "Kafka at " + d.o.kafkaBrokers + ", topic " + d.topic
		undo = append(undo, func() {
			if err := payments.DeleteTopic(context.WithoutCancel(ctx), d.ep, d.topic); err != nil {
				d.say("idem demo: could not delete topic %s on %s: %v", d.topic, d.o.kafkaBrokers, err)
			}
		})
	default:
		c, err := payments.StartKafka()
		if err != nil {
			return stop, err
		}
		undo = append(undo, c.Close)
		d.ep.Addr = strings.Join(c.ListenAddrs(), ",")
		d.brokerDesc = "an in-process Kafka-protocol broker (kfake) at " + d.ep.Addr + " (no --kafka-brokers or KAFKA_BROKERS)"
	}
	d.ep.Topic = d.topic
	if err := payments.CreateTopic(ctx, d.ep, d.topic); err != nil {
		return stop, err
	}
	if d.o.broker == payments.Kafka {
		if floor, err := payments.SessionFloor(ctx, strings.Split(d.ep.Addr, ","), d.topic); err == nil && floor > time.Second {
			d.sessionNote = fmt.Sprintf("  The broker's group.min.session.timeout.ms is %s, so consumers use %s sessions and a restart moves\n"+
				"  partitions slowly; a test broker may allow 1000 ms (scripts/services and docker-compose.yml do).", floor, floor)
		}
	}
	return stop, nil
}

// announce says what the run is about to do (stderr).
func (d *demoRun) announce(reset bool) {
	d.say("idem demo: %d payments through %s", d.o.n, d.brokerDesc)
	fresh := "new"
	if reset {
		fresh = "reset"
	}
	d.say("  Postgres %s, schema %s (%s); SMTP receiver at %s; seed %d", redact.DSN(d.e.databaseURL), d.schema, fresh, d.box.Addr(), d.o.seed)
	d.say("  chaos: the producer sends 30%% twice; consumers get extra copies and redeliveries after ack,")
	d.say("  3 consumers restart at random, database connections are cut twice; 2 email dispatchers.")
	if d.sessionNote != "" {
		d.say("%s", d.sessionNote)
	}
}

// demoInstances is how many consumer instances the demo runs.
const demoInstances = 3

// run publishes the payments under chaos, with the consumers, the dispatchers,
// the restarter and the backend cuts running, waits until the audit settles,
// stops everything, and returns the audit of the stopped system.
func (d *demoRun) run(ctx context.Context) (chaos.Report, time.Duration, error) {
	a, err := chaos.NewAuditor(chaos.AuditorConfig{Pool: d.db, Schema: d.schema, SettlePoll: 250 * time.Millisecond, SettleQuiet: 10 * time.Second})
	if err != nil {
		return chaos.Report{}, 0, err
	}
	dispatchers := make([]*effects.Dispatcher, 2)
	for i := range dispatchers {
		if dispatchers[i], err = payments.NewDispatcher(d.workers, d.schema, d.box.Addr(), 2*time.Second, nil, nil); err != nil {
			return chaos.Report{}, 0, err
		}
	}

	start := time.Now()
	runCtx, stopRun := context.WithCancel(ctx)
	defer stopRun()
	var wg sync.WaitGroup
	var runErr atomic.Pointer[error]
	fail := func(err error) {
		if err != nil && runCtx.Err() == nil {
			runErr.CompareAndSwap(nil, &err)
			stopRun()
		}
	}
	stops := make([]atomic.Pointer[context.CancelFunc], demoInstances)
	for i := range stops {
		wg.Go(func() { fail(d.consume(runCtx, i, &stops[i])) })
	}
	for _, disp := range dispatchers {
		wg.Go(func() { fail(disp.Run(runCtx)) })
	}
	wg.Go(func() { d.restartAtRandom(runCtx, stops) })
	d.bar = d.e.progress()
	watched := d.watch(runCtx, start)
	keys, err := d.produce(runCtx)
	fail(err)

	q := payments.AuditQuery(d.schema, keys, d.box.Counts, false)
	settleCtx, cancelSettle := context.WithTimeout(runCtx, time.Duration(max(60, d.o.n/20))*time.Second)
	_, settleErr := a.Settled(settleCtx, q)
	cancelSettle()
	stopRun()
	wg.Wait()
	<-watched
	var rows int
	if err := d.db.QueryRow(ctx, payments.LedgerRowsSQL(d.schema)).Scan(&rows); err == nil {
		d.bar.end(d.state(rows, start)) // the final state
	} else {
		d.bar.end("")
	}
	if p := runErr.Load(); p != nil {
		return chaos.Report{}, 0, *p
	}
	if settleErr != nil {
		return chaos.Report{}, 0, fmt.Errorf("the run did not settle: %w", settleErr)
	}
	// The last figures, with every worker stopped.
	rep, err := a.Report(ctx, q)
	if err != nil {
		return chaos.Report{}, 0, err
	}
	rep.Deliveries, rep.DuplicatesSuppressed = d.deliveries.Load(), d.suppressed.Load()
	return rep, time.Since(start), nil
}

// consume runs consumer instance i until ctx ends: each generation runs until
// the restarter cancels it (through stop), then the instance comes back with a
// new connection and no memory. An instance that fails on its own is restarted,
// as a supervisor would; one that keeps failing ends the demo with its error.
func (d *demoRun) consume(ctx context.Context, i int, stop *atomic.Pointer[context.CancelFunc]) error {
	failures := 0
	for gen := 0; ctx.Err() == nil; gen++ {
		c, err := payments.Connect(d.ep, nil)
		if err != nil {
			return err
		}
		sub, err := chaos.NewSubscriber(c.Subscriber, chaos.Config{
			Seed:                 d.o.seed + int64(i*1000+gen),
			DuplicateProbability: 0.1, MaxCopies: 2,
			RedeliverProbability: 0.05, RedeliverDelay: 100 * time.Millisecond,
			ReorderWindow: 4,
		})
		if err != nil {
			return err
		}
		reg := prometheus.NewRegistry()
		ictx, cancel := context.WithCancel(ctx)
		stop.Store(&cancel)
		err = payments.RunConsumer(ictx, payments.ConsumerConfig{Pool: d.workers, Schema: d.schema, Subscriber: sub, Topic: d.topic, Registerer: reg})
		restarted := ictx.Err() != nil // stopped on purpose, perhaps mid-subscribe
		cancel()
		_ = sub.Close()
		c.Close()
		d.deliveries.Add(sub.Stats().Delivered)
		d.suppressed.Add(counterSum(reg, "idem_inbox_duplicates_total"))
		switch {
		case err == nil || restarted:
			failures = 0
		case failures < 10:
			failures++
			time.Sleep(100 * time.Millisecond)
		default:
			return err
		}
	}
	return nil
}

// restartAtRandom stops a random consumer instance every 0.4–1.2 s until ctx
// ends.
func (d *demoRun) restartAtRandom(ctx context.Context, stops []atomic.Pointer[context.CancelFunc]) {
	rng := rand.New(rand.NewPCG(uint64(d.o.seed), 1))
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(400*time.Millisecond + time.Duration(rng.IntN(800))*time.Millisecond):
		}
		if stop := stops[rng.IntN(len(stops))].Load(); stop != nil {
			(*stop)()
			d.restarts.Add(1)
		}
	}
}

// watch cuts the schema's database connections when a third and two thirds of
// the payments are committed, and redraws the progress bar, until ctx ends; the
// channel closes when it has stopped.
func (d *demoRun) watch(ctx context.Context, start time.Time) <-chan struct{} {
	done := make(chan struct{})
	cutAt := []int{d.o.n / 3, 2 * d.o.n / 3}
	go func() {
		defer close(done)
		tick := time.NewTicker(200 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			var rows int
			if err := d.db.QueryRow(ctx, payments.LedgerRowsSQL(d.schema)).Scan(&rows); err != nil {
				continue
			}
			for len(cutAt) > 0 && rows >= cutAt[0] {
				cutAt = cutAt[1:]
				if _, err := payments.TerminateBackends(ctx, d.db, d.schema); err == nil {
					d.cuts.Add(1)
				}
			}
			d.bar.show(float64(rows)/float64(max(d.o.n, 1)), d.state(rows, start))
		}
	}()
	return done
}

// produce publishes the payments in batches of 50 through a publisher that sends
// 30% of them twice, and returns the keys it published.
func (d *demoRun) produce(ctx context.Context) ([]string, error) {
	c, err := payments.Connect(d.ep, nil)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	pub, err := chaos.NewPublisher(c.Publisher, chaos.PublisherConfig{Seed: d.o.seed, DuplicateProbability: 0.3})
	if err != nil {
		return nil, err
	}
	keys := make([]string, 0, d.o.n)
	for len(keys) < d.o.n {
		batch := make([]*message.Message, 0, 50)
		for len(batch) < cap(batch) && len(keys)+len(batch) < d.o.n {
			batch = append(batch, payments.NewMessage(int64(100+len(keys)+len(batch))))
		}
		if err = publishRetry(ctx, pub, d.topic, batch); err != nil {
			break
		}
		for _, msg := range batch {
			keys = append(keys, msg.UUID)
		}
	}
	d.producerDups.Store(pub.Duplicates())
	return keys, err
}

// state is the progress line: payments committed, emails sent, restarts and
// cuts so far.
func (d *demoRun) state(committed int, start time.Time) string {
	return fmt.Sprintf("%d/%d committed, %d emails, %d restarts, %d cuts, %s",
		committed, d.o.n, d.box.Total(), d.restarts.Load(), d.cuts.Load(), time.Since(start).Round(100*time.Millisecond))
}

// report prints the run's summary and the auditor's table, or the JSON with
// --json, and fails unless nothing was lost or committed twice.
func (d *demoRun) report(rep chaos.Report, elapsed time.Duration) error {
	if d.e.json {
		if err := d.e.writeJSON(d.json(rep, elapsed)); err != nil {
			return err
		}
	} else {
		fmt.Fprintf(d.e.stdout, "%d payments through %s in %s: producer duplicates %d, consumer restarts %d, backend cuts %d\n\n",
			d.o.n, d.brokerDesc, elapsed.Round(100*time.Millisecond), d.producerDups.Load(), d.restarts.Load(), d.cuts.Load())
		titled := rep
		titled.Consumer = "idem on " + d.o.broker
		fmt.Fprint(d.e.stdout, titled.String())
	}
	if !rep.OK() {
		return rep.Err()
	}
	if !d.e.json {
		fmt.Fprintf(d.e.stdout, "\nEvery payment committed once and every receipt was emailed; lost = 0, committed twice = 0.\n")
	}
	return nil
}

// json is the --json form of the run.
func (d *demoRun) json(rep chaos.Report, elapsed time.Duration) demoJSON {
	var out demoJSON
	out.Broker, out.BrokerAddress, out.Schema, out.Seed, out.ElapsedSeconds = d.o.broker, d.ep.Addr, d.schema, d.o.seed, math.Round(elapsed.Seconds()*100)/100
	if d.o.broker == payments.Kafka && d.o.kafkaBrokers != "" {
		out.Topic = d.topic
	}
	out.Restarts, out.BackendCuts, out.ProducerDups = d.restarts.Load(), d.cuts.Load(), d.producerDups.Load()
	r := &out.Report
	r.Messages, r.CommittedOnce, r.CommittedTwice, r.Lost, r.Failed = rep.Messages, rep.CommittedOnce, rep.CommittedTwice, rep.Lost, rep.Failed
	r.Deliveries, r.DuplicatesSuppressed = rep.Deliveries, rep.DuplicatesSuppressed
	r.EffectsDone, r.EffectsDead, r.EffectsPending = rep.EffectsDone, rep.EffectsDead, rep.EffectsPending
	r.SendsTotal, r.SendsOnce, r.SendsRepeated, r.SendsMissing = rep.SendsTotal, rep.SendsOnce, rep.SendsRepeated, rep.SendsMissing
	out.OK = rep.OK()
	return out
}

// publishRetry publishes a batch until it goes through: a producer keeps the
// messages' IDs on every retry, so a retry that doubles a message is a duplicate.
func publishRetry(ctx context.Context, pub message.Publisher, topic string, batch []*message.Message) error {
	var err error
	for range 50 {
		if err = pub.Publish(topic, batch...); err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	return fmt.Errorf("publish: %w", err)
}

func counterSum(reg *prometheus.Registry, name string) int64 {
	mfs, _ := reg.Gather()
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() == name {
			for _, m := range mf.GetMetric() {
				sum += m.GetCounter().GetValue()
			}
		}
	}
	return int64(math.Round(sum))
}
