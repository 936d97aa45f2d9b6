// Command quickstart is the README's usage, runnable: a Watermill router whose
// payments handler runs behind the idem middleware, and a Dispatcher that sends
// the receipt emails the handler enqueues. Over an in-process Watermill channel
// (your Kafka or NATS subscriber in a service), it delivers one payment three
// times and prints what was committed and sent.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"log/slog"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/migrate"
)

func main() {
	schema := flag.String("schema", "idem_quickstart", "schema of the idem tables and the ledger (migrated on start)")
	flag.Parse()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	err := run(ctx, os.Getenv("DATABASE_URL"), *schema)
	cancel()
	if err != nil {
		log.Fatal(err)
	}
}

// Payment is the message the payments topic carries.
type Payment struct {
	ID     string `json:"id"`
	Amount int64  `json:"amount"`
}

// addPaymentsHandler adds the payments handler behind idem, with Watermill's
// PoisonQueue and Retry outside it.
func addPaymentsHandler(router *message.Router, pool *pgxpool.Pool, schema string, sub message.Subscriber, pub message.Publisher) error {
	idem, err := consumer.New(consumer.Config{Pool: pool, Schema: schema}) // Name: the handler's name
	if err != nil {
		return err
	}
	poison, err := middleware.PoisonQueueWithFilter(pub, "payments.poison", consumer.IsPermanent)
	if err != nil {
		return err
	}
	retry := middleware.Retry{MaxRetries: 5, InitialInterval: 100 * time.Millisecond, ShouldRetry: consumer.ShouldRetry}

	router.AddHandler("payments", "payments", sub, "receipts", pub,
		func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			tx := consumer.Tx(ctx) // the transaction idem opened for this message
			var p Payment
			if err := json.Unmarshal(msg.Payload, &p); err != nil {
				return nil, consumer.Permanent(err) // recorded as failed, never retried
			}
			if _, err := tx.Exec(ctx, `INSERT INTO ledger (payment_id, amount) VALUES ($1, $2)`, p.ID, p.Amount); err != nil {
				return nil, err // transient: rolled back and nacked
			}
			_, err := effects.Enqueue(ctx, tx, effects.Effect{
				Kind: "email", Key: "receipt:" + p.ID, Payload: msg.Payload,
			})
			// Returned messages are stored as "publish:receipts" effects with stable IDs.
			return []*message.Message{message.NewMessage("", msg.Payload)}, err
		}).AddMiddleware(poison, retry.Middleware, idem.Middleware) // outside first
	return nil
}

// run migrates schema, starts the router and a Dispatcher, publishes one
// payment three times, and waits until it is settled and its effects are done.
func run(ctx context.Context, databaseURL, schema string) error {
	cfg, err := pgxpool.ParseConfig(databaseURL)
	if err != nil {
		return err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema // the ledger lives next to idem's tables
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: schema})
	if err != nil {
		return err
	}
	if _, err := m.Up(ctx); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS ledger (payment_id text, amount bigint)`); err != nil {
		return err
	}

	logger := watermill.NewSlogLogger(slog.New(slog.DiscardHandler))
	bus := gochannel.NewGoChannel(gochannel.Config{}, logger) // Kafka or NATS in a service
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return err
	}
	if err := addPaymentsHandler(router, pool, schema, bus, bus); err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() { _ = router.Run(ctx) }() // its error is Close's
	defer func() { _ = router.Close() }()
	<-router.Running()

	d, err := effects.NewDispatcher(effects.Config{
		Pool: pool, Schema: schema,
		Senders: map[string]effects.Sender{
			"email": effects.SenderFunc(func(ctx context.Context, d effects.Delivery) error {
				fmt.Println("sending", d.Key) // an SMTP client in a service, d.Key its Message-ID
				return nil
			}),
			effects.PublishKindPrefix + "receipts": effects.PublishSender(bus),
		},
	})
	if err != nil {
		return err
	}
	go func() { _ = d.Run(ctx) }()

	payment := message.NewMessage("pay_789", []byte(`{"id":"pay_789","amount":42}`))
	for range 3 { // a redelivery and a producer retry
		if err := bus.Publish("payments", payment.Copy()); err != nil {
			return err
		}
	}
	// Wait until the message is settled and every effect is done.
	for {
		var settled bool
		err := pool.QueryRow(ctx, `SELECT
			EXISTS (SELECT FROM inbox WHERE key = 'pay_789' AND state = 'completed')
			AND NOT EXISTS (SELECT FROM effects WHERE state <> 'done')`).Scan(&settled)
		if err != nil {
			return err
		}
		if settled {
			break
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
	var rows, emails int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM ledger WHERE payment_id = 'pay_789'`).Scan(&rows); err != nil {
		return err
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM effects WHERE kind = 'email' AND state = 'done'`).Scan(&emails); err != nil {
		return err
	}
	fmt.Println("ledger rows for pay_789:", rows, "receipt emails sent:", emails)
	return nil
}
