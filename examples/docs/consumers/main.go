// Command consumers is docs/consumers.md's opening program: a payments handler
// on NATS JetStream behind idem's middleware, keyed by the payment's ID, with
// Watermill's PoisonQueue and Retry outside it. A payment sent twice under two
// message IDs commits one ledger row; a message that is not JSON goes to the
// poison topic.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log"
	"os"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5/pgxpool"
	natsgo "github.com/nats-io/nats.go"

	idemnats "github.com/idemkit/idem/adapters/nats"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/migrate"
)

// Payment is the message the payments topic carries.
type Payment struct {
	ID     string `json:"id"`
	Amount int64  `json:"amount"`
}

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	check(err)
	defer pool.Close()
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: "docs_consumers"}) // idem's tables
	check(err)
	_, err = m.Up(ctx)
	check(err)
	_, err = pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS docs_consumers.ledger (payment_id text, amount bigint)`)
	check(err)

	nc, err := natsgo.Connect(os.Getenv("NATS_URL"))
	check(err)
	defer nc.Close()
	topo := idemnats.Topology{AutoProvision: true}
	pub, err := idemnats.NewPublisher(nc, idemnats.PublisherConfig{Topology: topo})
	check(err)
	sub, err := idemnats.NewSubscriber(nc, idemnats.SubscriberConfig{Topology: topo, Durable: "docs-consumers"})
	check(err)
	poisoned, err := sub.Subscribe(ctx, "docs-consumers-poison")
	check(err)

	idem, err := consumer.New(consumer.Config{
		Pool: pool, Schema: "docs_consumers",
		// The key is the payment's ID, so a payment sent twice under two message IDs runs once.
		Key: consumer.BusinessKey(func(payload []byte) (string, error) {
			var p Payment
			err := json.Unmarshal(payload, &p)
			return "payment:" + p.ID, err // an error is permanent: the PoisonQueue takes the message
		}),
	})
	check(err)
	poison, err := middleware.PoisonQueueWithFilter(pub, "docs-consumers-poison", consumer.IsPermanent)
	check(err)
	retry := middleware.Retry{MaxRetries: 5, InitialInterval: 100 * time.Millisecond, ShouldRetry: consumer.ShouldRetry}

	var settled atomic.Int64
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	check(err)
	router.AddConsumerHandler("docs-consumers", "docs-consumers-payments", sub, func(msg *message.Message) error {
		ctx := msg.Context()
		var p Payment
		if err := json.Unmarshal(msg.Payload, &p); err != nil {
			return consumer.Permanent(err) // recorded as failed, never retried
		}
		_, err := consumer.Tx(ctx).Exec(ctx, // the transaction idem opened for this message
			`INSERT INTO docs_consumers.ledger (payment_id, amount) VALUES ($1, $2)`, p.ID, p.Amount)
		return err // any other error is transient: rolled back and nacked
	}).AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil {
				settled.Add(1) // acked: run, recorded, deduped or poisoned
			}
			return out, err
		}
	}, poison, retry.Middleware, idem.Middleware) // outside first: idem's is the innermost
	go func() { _ = router.Run(ctx) }()
	defer func() { _ = router.Close() }()
	<-router.Running()

	id := watermill.NewUUID() // a new payment each run
	payment := fmt.Appendf(nil, `{"id":%q,"amount":42}`, id)
	check(pub.Publish("docs-consumers-payments",
		message.NewMessage(watermill.NewUUID(), payment),
		message.NewMessage(watermill.NewUUID(), payment), // the same payment, sent again
		message.NewMessage(watermill.NewUUID(), []byte("not json"))))
	for settled.Load() < 3 && ctx.Err() == nil {
		time.Sleep(50 * time.Millisecond)
	}
	var rows int
	check(pool.QueryRow(ctx, `SELECT count(*) FROM docs_consumers.ledger WHERE payment_id = $1`, id).Scan(&rows))
	fmt.Println("settled", settled.Load(), "messages; ledger rows for the payment:", rows)
	p := <-poisoned
	p.Ack()
	fmt.Printf("on the poison topic: %q\n", p.Payload) // its reason in p.Metadata[middleware.ReasonForPoisonedKey]
}

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}
