// Command chaos is docs/chaos.md's opening program: a NATS consumer behind
// idem's middleware, whose subscriber the chaos package wraps to deliver copies
// of each message, deliver it again after the ack, and reorder. The Auditor
// then checks the database: every payment committed once, none lost.
package main

import (
	"context"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	natsgo "github.com/nats-io/nats.go"

	idemnats "github.com/idemkit/idem/adapters/nats"
	"github.com/idemkit/idem/chaos"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/migrate"
)

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	check(err)
	defer pool.Close()
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: "docs_chaos"}) // idem's tables
	check(err)
	_, err = m.Up(ctx)
	check(err)
	_, err = pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS docs_chaos.ledger (payment text, run text)`)
	check(err)
	idem, err := consumer.New(consumer.Config{Pool: pool, Schema: "docs_chaos"})
	check(err)

	nc, err := natsgo.Connect(os.Getenv("NATS_URL"))
	check(err)
	defer nc.Close()
	topo := idemnats.Topology{AutoProvision: true}
	pub, err := idemnats.NewPublisher(nc, idemnats.PublisherConfig{Topology: topo})
	check(err)
	natsSub, err := idemnats.NewSubscriber(nc, idemnats.SubscriberConfig{Topology: topo, Durable: "docs-chaos"})
	check(err)
	sub, err := chaos.NewSubscriber(natsSub, chaos.Config{ // the subscriber your router already uses, wrapped
		Seed:                 42,              // same seed, same faults on the same messages
		DuplicateProbability: 1, MaxCopies: 2, // extra copies next to the original
		RedeliverProbability: 1, RedeliverDelay: 20 * time.Millisecond, // delivered again after it was acked
		ReorderWindow: 4, // shuffled within 4 messages
	})
	check(err)

	run := watermill.NewUUID() // this run's payments
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	check(err)
	router.AddConsumerHandler("docs-chaos", "docs-chaos-payments", sub, func(msg *message.Message) error {
		_, err := consumer.Tx(msg.Context()).Exec(msg.Context(), `INSERT INTO docs_chaos.ledger VALUES ($1, $2)`, msg.UUID, run)
		return err
	}).AddMiddleware(idem.Middleware)
	go func() { _ = router.Run(ctx) }()
	defer func() { _ = router.Close() }()
	<-router.Running()

	var ids []string
	for i := range 20 {
		msg := message.NewMessage(fmt.Sprintf("%s-%02d", run, i), []byte(`{"amount":10}`))
		ids = append(ids, msg.UUID)
		check(pub.Publish("docs-chaos-payments", msg))
	}

	auditor, err := chaos.NewAuditor(chaos.AuditorConfig{Pool: pool, Schema: "docs_chaos"})
	check(err)
	rep, err := auditor.Settled(ctx, chaos.AuditQuery{
		Consumer:     "docs-chaos", // the handler's name, idem's default consumer name
		ExpectedKeys: ids,
		BusinessSQL:  `SELECT payment, count(*) FROM docs_chaos.ledger WHERE run = '` + run + `' GROUP BY 1`, // the ground truth
	})
	check(err)
	rep.Deliveries = sub.Stats().Delivered // a count of the process: read once the run has settled
	fmt.Println("ok:", rep.OK(), "once:", rep.CommittedOnce, "twice:", rep.CommittedTwice, "lost:", rep.Lost)
	fmt.Println("duplicates delivered:", rep.DuplicatesDelivered() > 0)
}

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}
