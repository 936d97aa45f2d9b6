// Command nats is docs/nats.md's first consumer: a Watermill router reads
// subject docs-nats-orders through durable consumer docs-nats, with idem's
// middleware around the handler. One order is published; its first ack is lost,
// so JetStream delivers it again; the handler's insert commits once.
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
	"github.com/idemkit/idem/migrate"
)

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool := must(pgxpool.New(ctx, os.Getenv("DATABASE_URL")))
	defer pool.Close()
	m := must(migrate.New(migrate.Config{Pool: pool, Schema: "docs_nats"})) // idem's tables
	must(m.Up(ctx))
	must(pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS docs_nats.orders (id text, total int)`))
	idem := must(consumer.New(consumer.Config{Pool: pool, Schema: "docs_nats"}))

	nc := must(natsgo.Connect(os.Getenv("NATS_URL"))) // yours: the adapters leave it open
	defer nc.Close()
	topo := idemnats.Topology{AutoProvision: true} // one stream per topic, subject = topic
	pub := must(idemnats.NewPublisher(nc, idemnats.PublisherConfig{Topology: topo}))
	defer func() { _ = pub.Close() }()
	sub, err := idemnats.NewSubscriber(nc, idemnats.SubscriberConfig{
		Topology: topo,
		Durable:  "docs-nats", // the consumer group: a name of this page's own
		NakDelay: func(uint64) time.Duration { return 100 * time.Millisecond },
	})
	check(err)

	id := watermill.NewUUID() // the idempotency key: a new order each run
	var deliveries, runs atomic.Int64
	router := must(message.NewRouter(message.RouterConfig{}, watermill.NopLogger{}))
	router.AddConsumerHandler("docs-nats", "docs-nats-orders", sub, func(msg *message.Message) error {
		runs.Add(1) // duplicates never get here
		_, err := consumer.Tx(msg.Context()).Exec(msg.Context(),
			`INSERT INTO docs_nats.orders VALUES ($1, 42)`, msg.UUID)
		return err
	}).AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil && msg.UUID == id && deliveries.Add(1) == 1 {
				return nil, errors.New("ack lost") // committed, but JetStream delivers it again
			}
			return out, err
		}
	}, idem.Middleware) // outside first: idem's middleware is the innermost
	go func() { _ = router.Run(ctx) }()
	defer func() { _ = router.Close() }()
	<-router.Running()

	msg := message.NewMessage(id, []byte(`{"total":42}`))
	check(pub.Publish("docs-nats-orders", msg))
	for deliveries.Load() < 2 && ctx.Err() == nil {
		time.Sleep(50 * time.Millisecond)
	}
	var rows int
	check(pool.QueryRow(ctx, `SELECT count(*) FROM docs_nats.orders WHERE id = $1`, id).Scan(&rows))
	fmt.Printf("deliveries %d, handler runs %d, order rows %d\n", deliveries.Load(), runs.Load(), rows)
}

// must and check stop the program on an error; a service would return it.
func must[T any](v T, err error) T {
	check(err)
	return v
}

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}
