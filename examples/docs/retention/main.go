// Command retention is docs/retention.md's opening program: a NATS consumer
// whose inbox rows live seven days, and the janitor that deletes them once they
// expired (here the program moves the clock: it sets expires_at in the past).
package main

import (
	"context"
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
	"github.com/idemkit/idem/janitor"
	"github.com/idemkit/idem/migrate"
)

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	check(err)
	defer pool.Close()
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: "docs_retention"}) // idem's tables
	check(err)
	_, err = m.Up(ctx)
	check(err)
	j, err := janitor.New(janitor.Config{Pool: pool, Schema: "docs_retention"})
	check(err)
	_, err = j.RunOnce(ctx) // what earlier runs left
	check(err)

	idem, err := consumer.New(consumer.Config{
		Pool: pool, Schema: "docs_retention",
		Retention: 7 * 24 * time.Hour, // the default: longer than the broker can redeliver
	})
	check(err)
	nc, err := natsgo.Connect(os.Getenv("NATS_URL"))
	check(err)
	defer nc.Close()
	topo := idemnats.Topology{AutoProvision: true}
	pub, err := idemnats.NewPublisher(nc, idemnats.PublisherConfig{Topology: topo})
	check(err)
	sub, err := idemnats.NewSubscriber(nc, idemnats.SubscriberConfig{Topology: topo, Durable: "docs-retention"})
	check(err)
	var handled atomic.Int64
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	check(err)
	router.AddConsumerHandler("docs-retention", "docs-retention-orders", sub, func(msg *message.Message) error {
		handled.Add(1)
		return nil
	}).AddMiddleware(idem.Middleware)
	go func() { _ = router.Run(ctx) }()
	defer func() { _ = router.Close() }()
	<-router.Running()

	id := watermill.NewUUID()
	check(pub.Publish("docs-retention-orders", message.NewMessage(id, []byte(`{}`))))
	for handled.Load() < 1 && ctx.Err() == nil {
		time.Sleep(50 * time.Millisecond)
	}
	st, err := j.RunOnce(ctx)
	check(err)
	fmt.Println("at once, inbox rows deleted:", st.InboxDeleted)
	_, err = pool.Exec(ctx, `UPDATE docs_retention.inbox SET expires_at = now() - interval '1 second' WHERE key = $1`, id)
	check(err) // as if the week had passed
	st, err = j.RunOnce(ctx)
	check(err)
	fmt.Println("a week later, inbox rows deleted:", st.InboxDeleted)
}

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}
