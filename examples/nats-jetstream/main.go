// Command nats-jetstream is an idem consumer on a NATS JetStream durable pull
// consumer: each order message makes one ledger row and one confirmation email
// effect, in one transaction with the inbox row. Run several copies with the same
// -durable and they share the messages; kill one (kill -9) and what it held comes
// back after its AckWait to the others, without a second ledger row or a second
// email effect.
//
// The emails are sent by a Dispatcher: run examples/notification-sender next to it
// (same -schema).
package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	natsgo "github.com/nats-io/nats.go"

	"github.com/idemkit/idem/adapters/nats"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/migrate"
)

// Topic carries the orders.
const Topic = "orders"

// Order is an order message's payload.
type Order struct {
	ID          string `json:"id"`
	Customer    string `json:"customer"`
	AmountCents int64  `json:"amount_cents"`
}

// Email is the payload of an "email" effect (the format examples/notification-sender sends).
type Email struct {
	To      string `json:"to"`
	Subject string `json:"subject"`
	Body    string `json:"body"`
}

// Config is what the consumer needs.
type Config struct {
	DatabaseURL string
	NATSURL     string
	Durable     string
	Schema      string
	// Publish, if above 0, first publishes that many sample orders, every fifth
	// one twice (a producer retry: same message ID).
	Publish int
	Logger  *slog.Logger
}

func main() {
	var cfg Config
	flag.StringVar(&cfg.DatabaseURL, "database-url", cmp.Or(os.Getenv("DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"), "Postgres URL (env DATABASE_URL)")
	flag.StringVar(&cfg.NATSURL, "nats-url", cmp.Or(os.Getenv("NATS_URL"), natsgo.DefaultURL), "NATS server URL (env NATS_URL)")
	flag.StringVar(&cfg.Durable, "durable", "orders-ledger", "durable consumer name")
	flag.StringVar(&cfg.Schema, "schema", "idem_example_orders", "schema of the idem tables and the ledger (migrated on start)")
	flag.IntVar(&cfg.Publish, "publish", 0, "publish this many sample orders first")
	flag.Parse()
	cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, nil))

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, cfg)
	stop()
	if err != nil {
		cfg.Logger.Error("nats-jetstream", "error", err)
		os.Exit(1)
	}
}

// run migrates, optionally publishes sample orders, and consumes until ctx ends.
func run(ctx context.Context, cfg Config) (err error) {
	pool, err := pgxpool.New(ctx, cfg.DatabaseURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := migrateSchema(ctx, pool, cfg.Schema); err != nil {
		return err
	}
	wlog := watermill.NewSlogLogger(cfg.Logger)

	nc, err := natsgo.Connect(cfg.NATSURL, natsgo.MaxReconnects(-1))
	if err != nil {
		return fmt.Errorf("connect to NATS at %s: %w", cfg.NATSURL, err)
	}
	defer nc.Close()
	// The stream "orders" and the durable are created when missing.
	topo := nats.Topology{AutoProvision: true}
	pub, err := nats.NewPublisher(nc, nats.PublisherConfig{Topology: topo, Logger: wlog})
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, pub.Close()) }()
	if cfg.Publish > 0 {
		if err := publishOrders(pub, cfg.Publish); err != nil {
			return err
		}
		cfg.Logger.Info("published sample orders", "orders", cfg.Publish)
	}

	sub, err := nats.NewSubscriber(nc, nats.SubscriberConfig{Topology: topo, Durable: cfg.Durable, Logger: wlog})
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, sub.Close()) }()

	idem, err := consumer.New(consumer.Config{
		Name:        "orders-ledger",
		Pool:        pool,
		Schema:      cfg.Schema,
		EffectKinds: []string{"email"},
		Logger:      cfg.Logger,
	})
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, idem.Close()) }()

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, wlog)
	if err != nil {
		return err
	}
	h := router.AddConsumerHandler("orders-ledger", Topic, sub, handleOrder(cfg.Schema))
	h.AddMiddleware(idem.Middleware)
	return router.Run(ctx)
}

// handleOrder runs inside idem's transaction: the ledger row and the email effect
// commit together with the inbox row, or not at all.
func handleOrder(schema string) message.NoPublishHandlerFunc {
	insert := `INSERT INTO ` + pgx.Identifier{schema, "order_ledger"}.Sanitize() + ` (order_id, customer, amount_cents) VALUES ($1, $2, $3)`
	return func(msg *message.Message) error {
		ctx := msg.Context()
		var o Order
		if err := json.Unmarshal(msg.Payload, &o); err != nil || o.ID == "" {
			return consumer.Permanent(fmt.Errorf("bad order: %v", cmp.Or(err, errors.New("no id"))))
		}
		tx := consumer.Tx(ctx)
		if _, err := tx.Exec(ctx, insert, o.ID, o.Customer, o.AmountCents); err != nil {
			return err // transient: rolled back, nacked, delivered again
		}
		email, _ := json.Marshal(Email{
			To:      o.Customer,
			Subject: "Order " + o.ID + " confirmed",
			Body:    fmt.Sprintf("Thank you. We charged %d.%02d.", o.AmountCents/100, o.AmountCents%100),
		})
		// The effect key is the email's identity on every attempt (its Message-ID).
		_, err := effects.Enqueue(ctx, tx, effects.Effect{Kind: "email", Key: "order-confirmation:" + o.ID, Payload: email})
		return err
	}
}

func migrateSchema(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: schema})
	if err != nil {
		return err
	}
	if _, err := m.Up(ctx); err != nil {
		return err
	}
	_, err = pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+pgx.Identifier{schema, "order_ledger"}.Sanitize()+` (
		id bigserial PRIMARY KEY, order_id text NOT NULL, customer text NOT NULL,
		amount_cents bigint NOT NULL, created_at timestamptz NOT NULL DEFAULT now())`)
	return err
}

// publishOrders publishes n orders; every fifth is published twice with the same
// message ID, as a producer that retried after a lost acknowledgement would. The
// message ID is the Nats-Msg-Id, so within the stream's duplicate window (2
// minutes) the server itself drops the copy; later, the inbox does.
func publishOrders(pub message.Publisher, n int) error {
	var msgs []*message.Message
	for i := range n {
		id := consumer.NewUUID() // one ID per order, kept on every retry
		payload, _ := json.Marshal(Order{ID: id, Customer: fmt.Sprintf("customer%d@example.com", i), AmountCents: int64(1000 + i)})
		msg := message.NewMessage(id, payload)
		msgs = append(msgs, msg)
		if i%5 == 0 {
			msgs = append(msgs, msg.Copy())
		}
	}
	return pub.Publish(Topic, msgs...)
}
