package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem/chaos"
	"github.com/idemkit/idem/cmd/idem/internal/payments"
	"github.com/idemkit/idem/cmd/idem/internal/scratch"
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
	setup: func(fs *flag.FlagSet) runFunc {
		var o demoOptions
		fs.IntVar(&o.n, "n", 1000, "payments to publish")
		fs.StringVar(&o.broker, "broker", payments.NATS, "nats (embedded JetStream) or kafka")
		fs.StringVar(&o.kafkaBrokers, "kafka-brokers", os.Getenv("KAFKA_BROKERS"),
			"with --broker kafka: Kafka brokers, comma-separated (default $KAFKA_BROKERS; empty: an in-process Kafka-protocol broker)")
		fs.Int64Var(&o.seed, "seed", 0, "seed of the chaos (0: from the clock)")
		return func(ctx context.Context, e *env, args []string) error {
			if len(args) > 0 {
				return usagef("takes no arguments, got %q", args)
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

func runDemo(ctx context.Context, e *env, o demoOptions) error {
	if o.n < 1 {
		return usagef("-n must be at least 1")
	}
	if o.broker != payments.NATS && o.broker != payments.Kafka {
		return usagef("--broker must be nats or kafka, got %q", o.broker)
	}
	schema := e.schema
	if schema == inbox.DefaultSchema || !e.schemaGiven { // $IDEM_SCHEMA names a real deployment's schema
		schema = demoSchema
	}
	if o.seed == 0 {
		o.seed = time.Now().UnixNano() % 1_000_000
	}
	say := func(format string, args ...any) { fmt.Fprintf(e.notes(), format+"\n", args...) }
	// Right after "docker compose up -d" the server may still be starting: wait
	// for it a little, so the quick start's two commands can follow each other.
	admin, err := e.connect(ctx)
	var ce *connectError
	for waited := time.Duration(0); err != nil && errors.As(err, &ce) && waited < demoWaitForPostgres && ctx.Err() == nil; waited += 500 * time.Millisecond {
		if waited == 0 {
			say("idem demo: waiting up to %s for Postgres at %s ...", demoWaitForPostgres, ce.host)
		}
		time.Sleep(500 * time.Millisecond)
		admin, err = e.connect(ctx)
	}
	if err != nil {
		return err // a connectError: exit code 3, as for every command
	}

	// A fresh schema each run, but only one the demo (or idem bench) made, and
	// never one another run is using.
	claimed, err := scratch.Claim(ctx, e.databaseURL, schema, "idem demo")
	if err != nil {
		return scratchError("--schema", "idem demo", demoSchema, err)
	}
	defer claimed.Release()
	m, err := inbox.NewMigrator(admin, schema)
	if err != nil {
		return err
	}
	if _, err := m.Up(ctx); err != nil {
		return fmt.Errorf("migrate schema %s: %w", schema, err)
	}
	if err := payments.CreateTables(ctx, admin, schema); err != nil {
		return err
	}
	workers, err := payments.NewPool(ctx, e.databaseURL, payments.ApplicationName(schema), 8)
	if err != nil {
		return err
	}
	defer workers.Close()

	// The broker.
	ep := payments.Endpoint{Broker: o.broker, Group: "payments-demo"}
	topic := payments.Topic
	var brokerDesc string
	switch o.broker {
	case payments.NATS:
		dir, err := os.MkdirTemp("", "idem-demo-nats-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		srv, err := payments.StartNATS(dir, -1)
		if err != nil {
			return err
		}
		defer func() { srv.Shutdown(); srv.WaitForShutdown() }()
		ep.Addr = srv.ClientURL()
		brokerDesc = "embedded NATS JetStream at " + ep.Addr
	case payments.Kafka:
		if b := o.kafkaBrokers; b != "" {
			ep.Addr = b
			// A topic and a group of their own per run: an earlier run's payments
			// stay in a real broker's topic and are not this run's, and a demo
			// running at the same time on another schema must not share them.
			topic = fmt.Sprintf("idem-demo-%s-%d", schema, time.Now().UnixNano())
			ep.Group = topic
			brokerDesc = "Kafka at " + b + ", topic " + topic
			defer func() {
				if err := payments.DeleteTopic(context.WithoutCancel(ctx), ep, topic); err != nil {
					say("idem demo: could not delete topic %s on %s: %v", topic, b, err)
				}
			}()
		} else {
			c, err := payments.StartKafka()
			if err != nil {
				return err
			}
			defer c.Close()
			ep.Addr = strings.Join(c.ListenAddrs(), ",")
			brokerDesc = "an in-process Kafka-protocol broker (kfake) at " + ep.Addr + " (no --kafka-brokers or KAFKA_BROKERS)"
		}
	}
	ep.Topic = topic
	if err := payments.CreateTopic(ctx, ep, topic); err != nil {
		return err
	}
	var sessionNote string
	if o.broker == payments.Kafka {
		if floor, err := payments.SessionFloor(ctx, strings.Split(ep.Addr, ","), topic); err == nil && floor > time.Second {
			sessionNote = fmt.Sprintf("  The broker's group.min.session.timeout.ms is %s, so consumers use %s sessions and a restart moves\n"+
				"  partitions slowly; a test broker may allow 1000 ms (scripts/services and docker-compose.yml do).", floor, floor)
		}
	}
	box, err := payments.StartMailbox("127.0.0.1:0")
	if err != nil {
		return err
	}
	defer box.Close()

	say("idem demo: %d payments through %s", o.n, brokerDesc)
	fresh := "new"
	if claimed.Reset {
		fresh = "reset"
	}
	say("  Postgres %s, schema %s (%s); SMTP receiver at %s; seed %d", redact.DSN(e.databaseURL), schema, fresh, box.Addr(), o.seed)
	say("  chaos: the producer sends 30%% twice; consumers get extra copies and redeliveries after ack,")
	say("  3 consumers restart at random, database connections are cut twice; 2 email dispatchers.")
	if sessionNote != "" {
		say("%s", sessionNote)
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

	// Consumers: each instance runs until the restarter ends it, then comes back
	// with a new connection and no memory.
	var deliveries, suppressed, restarts atomic.Int64
	const instances = 3
	stops := make([]atomic.Pointer[context.CancelFunc], instances)
	for i := range instances {
		wg.Go(func() {
			failures := 0
			for gen := 0; runCtx.Err() == nil; gen++ {
				c, err := payments.Connect(ep, nil)
				if err != nil {
					fail(err)
					return
				}
				sub, err := chaos.NewSubscriber(c.Subscriber, chaos.Config{
					Seed:                 o.seed + int64(i*1000+gen),
					DuplicateProbability: 0.1, MaxCopies: 2,
					RedeliverProbability: 0.05, RedeliverDelay: 100 * time.Millisecond,
					ReorderWindow: 4,
				})
				if err != nil {
					fail(err)
					return
				}
				reg := prometheus.NewRegistry()
				ictx, cancel := context.WithCancel(runCtx)
				stops[i].Store(&cancel)
				err = payments.RunConsumer(ictx, payments.ConsumerConfig{Pool: workers, Schema: schema, Subscriber: sub, Topic: topic, Registerer: reg})
				restarted := ictx.Err() != nil // stopped on purpose, perhaps mid-subscribe
				cancel()
				_ = sub.Close()
				c.Close()
				deliveries.Add(sub.Stats().Delivered)
				suppressed.Add(counterSum(reg, "idem_inbox_duplicates_total"))
				// An instance that fails on its own is restarted, as a supervisor
				// would; one that keeps failing ends the demo.
				switch {
				case err == nil || restarted:
					failures = 0
				case failures < 10:
					failures++
					time.Sleep(100 * time.Millisecond)
				default:
					fail(err)
					return
				}
			}
		})
	}
	// Dispatchers.
	for range 2 {
		d, err := payments.NewDispatcher(workers, schema, box.Addr(), 2*time.Second, nil, nil)
		if err != nil {
			return err
		}
		wg.Go(func() { fail(d.Run(runCtx)) })
	}
	// The restarter: a random consumer every 0.4–1.2 s.
	rng := rand.New(rand.NewPCG(uint64(o.seed), 1))
	wg.Go(func() {
		for {
			select {
			case <-runCtx.Done():
				return
			case <-time.After(400*time.Millisecond + time.Duration(rng.IntN(800))*time.Millisecond):
			}
			if stop := stops[rng.IntN(instances)].Load(); stop != nil {
				(*stop)()
				restarts.Add(1)
			}
		}
	})

	// Backend cuts, the progress bar, and the wait until the audit settles.
	a, err := chaos.NewAuditor(admin, schema)
	if err != nil {
		return err
	}
	var cuts atomic.Int64
	cutAt := []int{o.n / 3, 2 * o.n / 3}
	progressDone := make(chan struct{})
	go func() {
		defer close(progressDone)
		tick := time.NewTicker(200 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-runCtx.Done():
				return
			case <-tick.C:
			}
			var rows int
			if err := admin.QueryRow(runCtx, payments.LedgerRowsSQL(schema)).Scan(&rows); err != nil {
				continue
			}
			for len(cutAt) > 0 && rows >= cutAt[0] {
				cutAt = cutAt[1:]
				if _, err := payments.TerminateBackends(runCtx, admin, schema); err == nil {
					cuts.Add(1)
				}
			}
			progress(e, rows, box.Total(), o.n, restarts.Load(), cuts.Load(), time.Since(start))
		}
	}()
	// The producer.
	var pubDups atomic.Int64
	keys := make([]string, 0, o.n)
	{
		c, err := payments.Connect(ep, nil)
		if err != nil {
			return err
		}
		pub, err := chaos.NewPublisher(c.Publisher, chaos.PublisherConfig{Seed: o.seed, DuplicateProbability: 0.3})
		if err != nil {
			c.Close()
			return err
		}
		for len(keys) < o.n {
			batch := make([]*message.Message, 0, 50)
			for len(batch) < cap(batch) && len(keys)+len(batch) < o.n {
				batch = append(batch, payments.NewMessage(int64(100+len(keys)+len(batch))))
			}
			if err := publishRetry(runCtx, pub, topic, batch); err != nil {
				c.Close()
				fail(err)
				break
			}
			for _, msg := range batch {
				keys = append(keys, msg.UUID)
			}
		}
		pubDups.Store(pub.Duplicates())
		c.Close()
	}

	q := payments.AuditQuery(schema, keys, box.Counts, false)
	settleCtx, cancelSettle := context.WithTimeout(runCtx, time.Duration(max(60, o.n/20))*time.Second)
	rep, settleErr := a.Settled(settleCtx, q, chaos.SettleOptions{Poll: 250 * time.Millisecond, Quiet: 10 * time.Second})
	cancelSettle()
	stopRun()
	wg.Wait()
	<-progressDone
	var rows int
	if err := admin.QueryRow(ctx, payments.LedgerRowsSQL(schema)).Scan(&rows); err == nil {
		progress(e, rows, box.Total(), o.n, restarts.Load(), cuts.Load(), time.Since(start)) // the final state
	}
	fmt.Fprintln(e.notes())
	if p := runErr.Load(); p != nil {
		return *p
	}
	if settleErr != nil {
		return fmt.Errorf("the run did not settle: %w", settleErr)
	}
	// The last figures, with every worker stopped.
	if rep, err = a.Report(ctx, q); err != nil {
		return err
	}
	rep.Deliveries, rep.DuplicatesSuppressed = deliveries.Load(), suppressed.Load()
	elapsed := time.Since(start)

	if e.json {
		var out demoJSON
		out.Broker, out.BrokerAddress, out.Schema, out.Seed, out.ElapsedSeconds = o.broker, ep.Addr, schema, o.seed, math.Round(elapsed.Seconds()*100)/100
		if o.broker == payments.Kafka && o.kafkaBrokers != "" {
			out.Topic = topic
		}
		out.Restarts, out.BackendCuts, out.ProducerDups = restarts.Load(), cuts.Load(), pubDups.Load()
		r := &out.Report
		r.Messages, r.CommittedOnce, r.CommittedTwice, r.Lost, r.Failed = rep.Messages, rep.CommittedOnce, rep.CommittedTwice, rep.Lost, rep.Failed
		r.Deliveries, r.DuplicatesSuppressed = rep.Deliveries, rep.DuplicatesSuppressed
		r.EffectsDone, r.EffectsDead, r.EffectsPending = rep.EffectsDone, rep.EffectsDead, rep.EffectsPending
		r.SendsTotal, r.SendsOnce, r.SendsRepeated, r.SendsMissing = rep.SendsTotal, rep.SendsOnce, rep.SendsRepeated, rep.SendsMissing
		out.OK = rep.OK()
		if err := e.writeJSON(out); err != nil {
			return err
		}
	} else {
		fmt.Fprintf(e.stdout, "%d payments through %s in %s: producer duplicates %d, consumer restarts %d, backend cuts %d\n\n",
			o.n, brokerDesc, elapsed.Round(100*time.Millisecond), pubDups.Load(), restarts.Load(), cuts.Load())
		fmt.Fprint(e.stdout, chaos.FormatReports([]string{"idem on " + o.broker}, rep))
	}
	if !rep.OK() {
		return rep.Err()
	}
	if !e.json {
		fmt.Fprintf(e.stdout, "\nEvery payment committed once and every receipt was emailed; lost = 0, committed twice = 0.\n")
	}
	return nil
}

// publishRetry publishes a batch until it goes through: a producer keeps the
// messages' IDs on every retry, so a retry that doubles a message is a duplicate.
func publishRetry(ctx context.Context, pub message.Publisher, topic string, batch []*message.Message) error {
	var err error
	for attempt := 0; attempt < 50; attempt++ {
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

// progress draws the bar on stderr (not with --json).
func progress(e *env, committed, emailed, n int, restarts, cuts int64, elapsed time.Duration) {
	const width = 30
	done := min(width, committed*width/max(n, 1))
	fmt.Fprintf(e.notes(), "\r[%s%s] %d/%d committed, %d emails, %d restarts, %d cuts, %s ",
		strings.Repeat("#", done), strings.Repeat(".", width-done), committed, n, emailed, restarts, cuts,
		elapsed.Round(100*time.Millisecond))
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
