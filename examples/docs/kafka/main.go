// Command kafka is docs/kafka.md's first consumer: a Watermill router reads
// topic docs-kafka-orders in consumer group docs-kafka, with idem's middleware
// around the handler. One order is published three times; the handler's insert
// commits once.
package main

import (
	"context"
	"fmt"
	"log"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/migrate"
)

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool := must(pgxpool.New(ctx, os.Getenv("DATABASE_URL")))
	defer pool.Close()
	m := must(migrate.New(migrate.Config{Pool: pool, Schema: "docs_kafka"})) // idem's tables
	must(m.Up(ctx))
	must(pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS docs_kafka.orders (id text, total int)`))
	idem := must(consumer.New(consumer.Config{Pool: pool, Schema: "docs_kafka"}))

	brokers := strings.Split(os.Getenv("KAFKA_BROKERS"), ",")
	cfg := kafka.SubscriberConfig{}
	cfg.Brokers = brokers
	cfg.GroupID = "docs-kafka" // a group of this page's own
	sub := must(kafka.NewSubscriber(cfg))
	check(sub.SubscribeInitialize("docs-kafka-orders")) // creates the topic if missing
	pcfg := kafka.PublisherConfig{}
	pcfg.Brokers = brokers
	pub := must(kafka.NewPublisher(pcfg))
	defer func() { _ = pub.Close() }()

	id := watermill.NewUUID() // the idempotency key: a new order each run
	var deliveries, runs atomic.Int64
	router := must(message.NewRouter(message.RouterConfig{}, watermill.NopLogger{}))
	router.AddConsumerHandler("docs-kafka", "docs-kafka-orders", sub, func(msg *message.Message) error {
		runs.Add(1) // duplicates never get here
		_, err := consumer.Tx(msg.Context()).Exec(msg.Context(),
			`INSERT INTO docs_kafka.orders VALUES ($1, 42)`, msg.UUID)
		return err
	}).AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil && msg.UUID == id {
				deliveries.Add(1)
			}
			return out, err
		}
	}, idem.Middleware) // outside first: idem's middleware is the innermost
	go func() { _ = router.Run(ctx) }()
	defer func() { _ = router.Close() }()
	<-router.Running()

	msg := message.NewMessage(id, []byte(`{"total":42}`))
	check(pub.Publish("docs-kafka-orders", msg, msg.Copy(), msg.Copy())) // a producer retrying twice
	for deliveries.Load() < 3 && ctx.Err() == nil {
		time.Sleep(50 * time.Millisecond)
	}
	var rows int
	check(pool.QueryRow(ctx, `SELECT count(*) FROM docs_kafka.orders WHERE id = $1`, id).Scan(&rows))
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
