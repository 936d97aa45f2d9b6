// Command effects is docs/effects.md's opening program: a NATS consumer whose
// handler enqueues two effects in its transaction, a receipt email and a ledger
// entry, and a Dispatcher that sends them: the email through a SenderFunc, the
// entry through the built-in ledger sender. The order is delivered twice (its
// first ack is lost); each effect is sent once.
package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	natsgo "github.com/nats-io/nats.go"

	idemnats "github.com/idemkit/idem/adapters/nats"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/migrate"
)

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	check(err)
	defer pool.Close()
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: "docs_effects"}) // idem's tables
	check(err)
	_, err = m.Up(ctx)
	check(err)
	// The ledger sender's table: a unique effect_key and a payload column.
	_, err = pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS docs_effects.ledger (effect_key text PRIMARY KEY, payload jsonb)`)
	check(err)

	// The Dispatcher: one Sender per kind. Usually a worker process of its own.
	ledger, err := effects.NewLedgerSender(effects.LedgerConfig{Pool: pool, Table: "docs_effects.ledger"})
	check(err)
	var emails atomic.Int64
	d, err := effects.NewDispatcher(effects.Config{
		Pool: pool, Schema: "docs_effects",
		Senders: map[string]effects.Sender{
			"email": effects.SenderFunc(func(ctx context.Context, d effects.Delivery) error {
				emails.Add(1) // an SMTP client in a service, with d.Key as the Message-ID
				return nil
			}),
			"ledger": ledger,
		},
	})
	check(err)
	go func() { _ = d.Run(ctx) }()

	idem, err := consumer.New(consumer.Config{Pool: pool, Schema: "docs_effects"})
	check(err)
	nc, err := natsgo.Connect(os.Getenv("NATS_URL"))
	check(err)
	defer nc.Close()
	topo := idemnats.Topology{AutoProvision: true}
	pub, err := idemnats.NewPublisher(nc, idemnats.PublisherConfig{Topology: topo})
	check(err)
	sub, err := idemnats.NewSubscriber(nc, idemnats.SubscriberConfig{
		Topology: topo, Durable: "docs-effects",
		NakDelay: func(uint64) time.Duration { return 100 * time.Millisecond },
	})
	check(err)
	id := watermill.NewUUID() // a new order each run
	var deliveries atomic.Int64
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	check(err)
	router.AddConsumerHandler("docs-effects", "docs-effects-orders", sub, func(msg *message.Message) error {
		ctx, tx := msg.Context(), consumer.Tx(msg.Context())
		// Both effects commit with the handler's work, or neither does.
		_, err := effects.EnqueueMany(ctx, tx, []effects.Effect{
			{Kind: "email", Key: "receipt:" + msg.UUID, Payload: msg.Payload},
			{Kind: "ledger", Key: "order:" + msg.UUID, Payload: msg.Payload},
		})
		return err
	}).AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil && msg.UUID == id && deliveries.Add(1) == 1 {
				return nil, errors.New("ack lost") // committed, but JetStream delivers it again
			}
			return out, err
		}
	}, idem.Middleware)
	go func() { _ = router.Run(ctx) }()
	defer func() { _ = router.Close() }()
	<-router.Running()

	check(pub.Publish("docs-effects-orders", message.NewMessage(id, []byte(`{"total":42}`))))
	var done int
	for (deliveries.Load() < 2 || done < 2) && ctx.Err() == nil {
		time.Sleep(50 * time.Millisecond)
		check(pool.QueryRow(ctx, `SELECT count(*) FROM docs_effects.effects WHERE key IN ($1, $2) AND state = 'done'`,
			"receipt:"+id, "order:"+id).Scan(&done))
	}
	var rows int
	check(pool.QueryRow(ctx, `SELECT count(*) FROM docs_effects.ledger WHERE effect_key = $1`, "order:"+id).Scan(&rows))
	fmt.Printf("deliveries %d, effects done %d, emails sent %d, ledger rows %d\n", deliveries.Load(), done, emails.Load(), rows)
}

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}
