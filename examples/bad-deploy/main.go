// Command bad-deploy walks through repairing a bad deploy, end to end, on a real
// Kafka broker and Postgres:
//
//  1. v1 of an orders consumer has a bug: it cannot parse an amount written with a
//     decimal comma ("12,50"). A third of the orders fail permanently: idem records
//     each failed key, and Watermill's PoisonQueue puts the message on a poison
//     topic.
//  2. The failures show as one failure group (admin.ListGroups, or `idem failures`).
//  3. v2, with the fix, is deployed. Republishing a failed message now changes
//     nothing: its key is recorded as failed, and the redelivery replays that.
//  4. The group is released, dry run first, with an audit note
//     (admin.ReleaseGroup, or `idem failures release`).
//  5. The messages are republished twice over: Watermill's requeuer moves the
//     poison topic back to the orders topic, and a plain Kafka publish sends the
//     same messages (same IDs) again, as a second operator might.
//  6. Every order is committed exactly once: one ledger row per order.
//
// It creates its topics (named after the run) and deletes them at the end; the
// schema (default idem_example_bad_deploy) is migrated and kept, and each run's
// orders are told apart by a run ID.
package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/requeuer"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	kafkago "github.com/segmentio/kafka-go"

	"github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/migrate"
)

// Consumer is the name of the orders consumer (its inbox rows' consumer).
const Consumer = "orders-ledger"

// Config is what a run needs.
type Config struct {
	DatabaseURL string
	Brokers     []string
	Schema      string
	// Orders is how many orders to publish; every third has a decimal comma.
	Orders int
	// Out gets the walkthrough; Logger the components' logs.
	Out    io.Writer
	Logger *slog.Logger
}

// Result is what a run found at its end.
type Result struct {
	RunID  string
	Orders int
	// Failed is how many orders v1 failed on; Released how many keys the release
	// deleted.
	Failed, Released int
	// LedgerRows and DistinctOrders are this run's ledger rows and the orders
	// they name; FailedKeys the failed keys left.
	LedgerRows, DistinctOrders, FailedKeys int
}

func main() {
	var cfg Config
	var brokers string
	flag.StringVar(&cfg.DatabaseURL, "database-url", cmp.Or(os.Getenv("DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"), "Postgres URL (env DATABASE_URL)")
	flag.StringVar(&brokers, "brokers", cmp.Or(os.Getenv("KAFKA_BROKERS"), "127.0.0.1:9092"), "Kafka brokers, comma-separated (env KAFKA_BROKERS)")
	flag.StringVar(&cfg.Schema, "schema", "idem_example_bad_deploy", "schema of the idem tables and the ledger (migrated on start)")
	flag.IntVar(&cfg.Orders, "orders", 30, "orders to publish; every third one has a decimal comma")
	flag.Parse()
	cfg.Brokers = strings.Split(brokers, ",")
	cfg.Out = os.Stdout
	cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	res, err := Run(ctx, cfg)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "bad-deploy:", err)
		os.Exit(1)
	}
	if res.LedgerRows != res.Orders || res.DistinctOrders != res.Orders || res.FailedKeys != 0 {
		os.Exit(1)
	}
}

// run is one walkthrough's state.
type run struct {
	cfg                  Config
	id                   string
	topic, poison, group string
	pool                 *pgxpool.Pool
	admin                *admin.Admin
	pub                  *kafka.Publisher
	wlog                 watermill.LoggerAdapter
	orders               []*message.Message
}

// Run does the walkthrough and returns what it found. The exactly-once check is
// the caller's (main exits 1 when it fails; the smoke test asserts it).
func Run(ctx context.Context, cfg Config) (res *Result, err error) {
	cfg.Orders = cmp.Or(cfg.Orders, 30)
	cfg.Out = cmp.Or[io.Writer](cfg.Out, io.Discard)
	cfg.Logger = cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler))
	id := strconv.FormatInt(time.Now().UnixNano()%1e9, 36)
	r := &run{cfg: cfg, id: id, topic: "orders-" + id, poison: "orders-" + id + ".poison", group: "orders-ledger-" + id,
		wlog: watermill.NewSlogLogger(cfg.Logger)}
	pcfg0, err := pgxpool.ParseConfig(cfg.DatabaseURL)
	if err != nil {
		return nil, err
	}
	// The walkthrough's own reads name the tables without their schema.
	pcfg0.ConnConfig.RuntimeParams["search_path"] = cfg.Schema
	pool, err := pgxpool.NewWithConfig(ctx, pcfg0)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	r.pool = pool
	if err := r.setup(ctx); err != nil {
		return nil, err
	}
	defer r.deleteTopics()
	pcfg := kafka.PublisherConfig{Logger: r.wlog}
	pcfg.Brokers = cfg.Brokers
	if r.pub, err = kafka.NewPublisher(pcfg); err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, r.pub.Close()) }()
	if r.admin, err = admin.New(admin.Config{Pool: pool, Schema: cfg.Schema}); err != nil {
		return nil, err
	}
	return r.walk(ctx)
}

func (r *run) say(format string, args ...any) { fmt.Fprintf(r.cfg.Out, format+"\n", args...) }

func (r *run) walk(ctx context.Context) (*Result, error) {
	res := &Result{RunID: r.id, Orders: r.cfg.Orders}
	r.say("== 1. Deploy v1. It parses amounts with strconv.ParseFloat: \"12,50\" fails.")
	for i := range r.cfg.Orders {
		amount := fmt.Sprintf("%d.50", 10+i)
		if i%3 == 2 {
			amount = fmt.Sprintf("%d,50", 10+i)
		}
		id := consumer.NewUUID()
		r.orders = append(r.orders, message.NewMessage(id, []byte(`{"id":"`+id+`","amount":"`+amount+`"}`)))
	}
	if err := r.pub.Publish(r.topic, r.orders...); err != nil {
		return nil, err
	}
	stopV1, err := r.consume(ctx, parseV1)
	if err != nil {
		return nil, err
	}
	if err := r.waitFor(ctx, "v1 to handle every order", func() (bool, error) {
		done, err := r.count(ctx, `SELECT count(*) FROM inbox WHERE consumer = $1 AND key = ANY($2)`, Consumer, r.ids())
		return done == r.cfg.Orders, err
	}); err != nil {
		return nil, err
	}
	if err := stopV1(); err != nil {
		return nil, err
	}
	ok, _ := r.count(ctx, `SELECT count(*) FROM order_ledger WHERE run_id = $1`, r.id)
	res.Failed, _ = r.count(ctx, `SELECT count(*) FROM inbox WHERE consumer = $1 AND key = ANY($2) AND state = 'failed'`, Consumer, r.ids())
	r.say("   %d orders published: %d committed, %d failed permanently (recorded in the inbox, and on topic %s).", r.cfg.Orders, ok, res.Failed, r.poison)

	r.say("\n== 2. The failures, as groups (idem failures --consumer %s):", Consumer)
	page, err := r.admin.ListGroups(ctx, admin.GroupFilter{Consumer: Consumer, Seen: admin.TimeRange{Since: time.Now().Add(-time.Hour)}}, admin.Page{})
	if err != nil {
		return nil, err
	}
	var group *admin.FailureGroup
	tw := tabwriter.NewWriter(r.cfg.Out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "   ID\tCOUNT\tCODE\tERROR (MASKED)")
	for i, g := range page.Rows {
		fmt.Fprintf(tw, "   %s\t%d\t%s\t%s\n", g.ID, g.Count, g.Code, g.Masked)
		if i == 0 {
			group = &page.Rows[0] // the largest: v1's bug
		}
	}
	_ = tw.Flush()
	if group == nil {
		return nil, errors.New("no failure group found")
	}
	r.say("   example: %s", group.Example)

	r.say("\n== 3. Deploy v2, which accepts the decimal comma. A republish alone does nothing yet:")
	stopV2, err := r.consume(ctx, parseV2)
	if err != nil {
		return nil, err
	}
	defer func() { _ = stopV2() }()
	bad := r.orders[2]
	if err := r.pub.Publish(r.topic, bad.Copy()); err != nil {
		return nil, err
	}
	if err := r.waitFor(ctx, "v2 to take the republished order", func() (bool, error) {
		n, err := r.lag(ctx, r.topic, r.group)
		return n == 0, err
	}); err != nil {
		return nil, err
	}
	state, _ := r.state(ctx, bad.UUID)
	r.say("   order %s republished: its key is still %s, the redelivery replayed the recorded failure.", bad.UUID, state)

	r.say("\n== 4. Release the group, dry run first (idem failures release %s --dry-run):", group.ID)
	act := admin.GroupAction{ID: group.ID, Through: group.LastSeen, Note: admin.Audit{Who: "ops@example.com", Why: "v2 parses decimal commas"}}
	dry := act
	dry.DryRun = true
	plan, err := r.admin.ReleaseGroup(ctx, dry)
	if err != nil {
		return nil, err
	}
	r.say("   would release %d failed key(s) that failed up to %s", plan.Rows, plan.Through.UTC().Format(time.RFC3339Nano))
	act.AtMost = plan.Rows // what the dry run showed, or nothing
	done, err := r.admin.ReleaseGroup(ctx, act)
	if err != nil {
		return nil, err
	}
	res.Released = int(done.Rows)
	r.say("   released %d key(s); action %s by %s: %q", done.Rows, done.ActionID, done.Who, done.Why)

	r.say("\n== 5. Republish, twice over: Watermill's requeuer moves %s back to %s,", r.poison, r.topic)
	r.say("   and a plain Kafka publish sends the same %d messages (same IDs) again.", res.Failed)
	stopRequeuer, err := r.requeue(ctx)
	if err != nil {
		return nil, err
	}
	var again []*message.Message
	for i, m := range r.orders {
		if i%3 == 2 {
			again = append(again, m.Copy())
		}
	}
	if err := r.pub.Publish(r.topic, again...); err != nil {
		return nil, err
	}
	if err := r.waitFor(ctx, "every republished order", func() (bool, error) {
		n, err := r.count(ctx, `SELECT count(*) FROM order_ledger WHERE run_id = $1`, r.id)
		if err != nil || n < r.cfg.Orders {
			return false, err
		}
		// Drained: the requeuer took every poisoned message, and the consumer
		// every message, the requeued ones included.
		p, err := r.lag(ctx, r.poison, r.group+"-requeuer")
		if err != nil || p > 0 {
			return false, err
		}
		o, err := r.lag(ctx, r.topic, r.group)
		return o == 0, err
	}); err != nil {
		return nil, err
	}
	if err := stopRequeuer(); err != nil {
		return nil, err
	}

	r.say("\n== 6. The outcome:")
	res.LedgerRows, _ = r.count(ctx, `SELECT count(*) FROM order_ledger WHERE run_id = $1`, r.id)
	res.DistinctOrders, _ = r.count(ctx, `SELECT count(DISTINCT order_id) FROM order_ledger WHERE run_id = $1`, r.id)
	res.FailedKeys, _ = r.count(ctx, `SELECT count(*) FROM inbox WHERE consumer = $1 AND key = ANY($2) AND state = 'failed'`, Consumer, r.ids())
	r.say("   %d orders, %d ledger rows, %d distinct orders, %d failed keys left.", res.Orders, res.LedgerRows, res.DistinctOrders, res.FailedKeys)
	if res.LedgerRows == res.Orders && res.DistinctOrders == res.Orders && res.FailedKeys == 0 {
		r.say("   Each order committed exactly once.")
	} else {
		r.say("   NOT exactly once!")
	}
	return res, nil
}

// parse is a version of the amount parser.
type parse func(amount string) (float64, error)

func parseV1(amount string) (float64, error) { return strconv.ParseFloat(amount, 64) }

func parseV2(amount string) (float64, error) {
	return strconv.ParseFloat(strings.Replace(amount, ",", ".", 1), 64)
}

// consume runs the orders consumer with parser p until the returned stop is
// called: a router with PoisonQueue (filtered on consumer.IsPermanent) outside
// idem's middleware, and idem recording each permanent failure before poisoning.
func (r *run) consume(ctx context.Context, p parse) (stop func() error, err error) {
	scfg := kafka.SubscriberConfig{Logger: r.wlog}
	scfg.Brokers, scfg.GroupID = r.cfg.Brokers, r.group
	sub, err := kafka.NewSubscriber(scfg)
	if err != nil {
		return nil, err
	}
	idem, err := consumer.New(consumer.Config{Name: Consumer, Pool: r.pool, Schema: r.cfg.Schema,
		PoisonOnPermanent: true, Logger: r.cfg.Logger})
	if err != nil {
		return nil, err
	}
	poison, err := middleware.PoisonQueueWithFilter(r.pub, r.poison, consumer.IsPermanent)
	if err != nil {
		return nil, err
	}
	insert := `INSERT INTO ` + pgx.Identifier{r.cfg.Schema, "order_ledger"}.Sanitize() + ` (run_id, order_id, amount) VALUES ($1, $2, $3)`
	return r.router(ctx, func(router *message.Router) {
		h := router.AddConsumerHandler(Consumer, r.topic, sub, func(msg *message.Message) error {
			var o struct{ ID, Amount string }
			if err := json.Unmarshal(msg.Payload, &o); err != nil {
				return consumer.Permanent(err)
			}
			amount, err := p(o.Amount)
			if err != nil {
				return consumer.Permanent(fmt.Errorf("order %s: amount %q: %w", o.ID, o.Amount, errors.Unwrap(err)))
			}
			ctx := msg.Context()
			_, err = consumer.Tx(ctx).Exec(ctx, insert, r.id, o.ID, amount)
			return err
		})
		h.AddMiddleware(poison, idem.Middleware)
	}, func() error { return idem.Close() })
}

// requeue runs Watermill's requeuer from the poison topic back to the topic each
// message was poisoned from, until the returned stop is called.
func (r *run) requeue(ctx context.Context) (stop func() error, err error) {
	scfg := kafka.SubscriberConfig{Logger: r.wlog}
	scfg.Brokers, scfg.GroupID = r.cfg.Brokers, r.group+"-requeuer"
	sub, err := kafka.NewSubscriber(scfg)
	if err != nil {
		return nil, err
	}
	return r.router(ctx, func(router *message.Router) {
		_, err = requeuer.NewRequeuer(requeuer.Config{
			Subscriber: sub, SubscribeTopic: r.poison, Publisher: r.pub, Router: router,
			GeneratePublishTopic: func(p requeuer.GeneratePublishTopicParams) (string, error) {
				return p.Message.Metadata.Get(middleware.PoisonedTopicKey), nil
			},
		}, r.wlog)
	}, nil)
}

// router starts a router with the handlers add adds, and returns a stop that
// closes it (then closing, if set) and returns how it ended.
func (r *run) router(ctx context.Context, add func(*message.Router), closing func() error) (func() error, error) {
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, r.wlog)
	if err != nil {
		return nil, err
	}
	add(router)
	ended := make(chan error, 1)
	go func() { ended <- router.Run(ctx) }()
	select {
	case <-router.Running():
	case err := <-ended:
		return nil, fmt.Errorf("router: %w", err)
	}
	var stopped bool
	return func() error {
		if stopped {
			return nil
		}
		stopped = true
		err := router.Close()
		if err == nil {
			err = <-ended
		}
		if closing != nil {
			err = errors.Join(err, closing())
		}
		return err
	}, nil
}

func (r *run) setup(ctx context.Context) error {
	m, err := migrate.New(migrate.Config{Pool: r.pool, Schema: r.cfg.Schema})
	if err != nil {
		return err
	}
	if _, err := m.Up(ctx); err != nil {
		return err
	}
	if _, err := r.pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+pgx.Identifier{r.cfg.Schema, "order_ledger"}.Sanitize()+` (
		run_id text NOT NULL, order_id text NOT NULL, amount numeric NOT NULL, created_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		return err
	}
	res, err := r.client().CreateTopics(ctx, &kafkago.CreateTopicsRequest{Topics: []kafkago.TopicConfig{
		{Topic: r.topic, NumPartitions: 3, ReplicationFactor: 1},
		{Topic: r.poison, NumPartitions: 1, ReplicationFactor: 1},
	}})
	if err != nil {
		return fmt.Errorf("create topics: %w", err)
	}
	for t, err := range res.Errors {
		if err != nil && !errors.Is(err, kafkago.TopicAlreadyExists) {
			return fmt.Errorf("create topic %s: %w", t, err)
		}
	}
	return nil
}

func (r *run) deleteTopics() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, _ = r.client().DeleteTopics(ctx, &kafkago.DeleteTopicsRequest{Topics: []string{r.topic, r.poison}})
}

func (r *run) client() *kafkago.Client {
	return &kafkago.Client{Addr: kafkago.TCP(r.cfg.Brokers...), Timeout: 10 * time.Second}
}

func (r *run) ids() []string {
	out := make([]string, len(r.orders))
	for i, m := range r.orders {
		out[i] = m.UUID
	}
	return out
}

func (r *run) count(ctx context.Context, sql string, args ...any) (int, error) {
	var n int
	err := r.pool.QueryRow(ctx, sql, args...).Scan(&n)
	return n, err
}

func (r *run) state(ctx context.Context, key string) (string, error) {
	var s string
	err := r.pool.QueryRow(ctx, `SELECT state FROM inbox WHERE consumer = $1 AND key = $2`, Consumer, key).Scan(&s)
	return s, err
}

// waitFor polls cond until it holds, for at most a minute.
func (r *run) waitFor(ctx context.Context, what string, cond func() (bool, error)) error {
	deadline := time.Now().Add(time.Minute)
	for {
		ok, err := cond()
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("waited a minute for %s: %v", what, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// lag is how many records of topic the group has not committed yet.
func (r *run) lag(ctx context.Context, topic, group string) (int64, error) {
	lag, err := kafka.Lag(ctx, r.client(), group, topic)
	return lag.Total, err
}
