// Command batch-handlers is docs/batch-handlers.md's opening program: a batch
// handler on NATS JetStream writes the payments of a whole batch with one
// INSERT … SELECT FROM unnest. Twenty payments are published twice (under new
// message IDs, as a producer that resends); each commits one ledger row.
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
	"github.com/jackc/pgx/v5"
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
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: "docs_batch"}) // idem's tables
	check(err)
	_, err = m.Up(ctx)
	check(err)
	_, err = pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS docs_batch.ledger (payment text PRIMARY KEY, amount bigint)`)
	check(err)

	nc, err := natsgo.Connect(os.Getenv("NATS_URL"))
	check(err)
	defer nc.Close()
	topo := idemnats.Topology{AutoProvision: true}
	pub, err := idemnats.NewPublisher(nc, idemnats.PublisherConfig{Topology: topo})
	check(err)
	sub, err := idemnats.NewSubscriber(nc, idemnats.SubscriberConfig{
		Topology: topo, Durable: "docs-batch",
		Concurrency: 64, // messages held at once: a batch can only hold what is in flight
	})
	check(err)

	idem, err := consumer.New(consumer.Config{
		Pool: pool, Schema: "docs_batch",
		Batch: consumer.BatchConfig{MaxBatch: 64},
		Key: consumer.BusinessKey(func(payload []byte) (string, error) {
			var p Payment
			err := json.Unmarshal(payload, &p)
			return p.ID, err
		}),
	})
	check(err)
	defer func() { _ = idem.Close() }()
	var got, settled atomic.Int64
	handler := idem.HandleBatch(func(ctx context.Context, tx pgx.Tx, msgs []*message.Message) error {
		var ids []string
		var amounts []int64
		for _, m := range msgs { // claimed keys only: duplicates never get here
			var p Payment
			if err := json.Unmarshal(m.Payload, &p); err != nil {
				return consumer.ForMessage(m, consumer.Permanent(err)) // the batch runs again without it
			}
			ids, amounts = append(ids, p.ID), append(amounts, p.Amount)
		}
		got.Add(int64(len(msgs)))
		_, err := tx.Exec(ctx, `INSERT INTO docs_batch.ledger SELECT * FROM unnest($1::text[], $2::bigint[])`, ids, amounts)
		return err
	})
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	check(err)
	router.AddConsumerHandler("docs-batch", "docs-batch-payments", sub, func(msg *message.Message) error {
		err := handler(msg) // returns when the message's batch has committed
		if err == nil {
			settled.Add(1)
		}
		return err
	})
	go func() { _ = router.Run(ctx) }()
	defer func() { _ = router.Close() }()
	<-router.Running()

	run := watermill.NewUUID() // new payment IDs each run
	for range 2 {
		var msgs []*message.Message
		for i := range 20 {
			payload := fmt.Appendf(nil, `{"id":"%s-%d","amount":%d}`, run, i, 10*i)
			msgs = append(msgs, message.NewMessage(watermill.NewUUID(), payload))
		}
		check(pub.Publish("docs-batch-payments", msgs...))
	}
	for settled.Load() < 40 && ctx.Err() == nil {
		time.Sleep(50 * time.Millisecond)
	}
	var rows int
	check(pool.QueryRow(ctx, `SELECT count(*) FROM docs_batch.ledger WHERE payment LIKE $1`, run+"-%").Scan(&rows))
	fmt.Printf("settled %d messages; the batch handler got %d; ledger rows: %d\n", settled.Load(), got.Load(), rows)
}

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}
