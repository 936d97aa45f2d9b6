// Command repair is docs/repair.md's opening program: a bad deploy fails three
// payments permanently; the operator reads the failure group with package
// admin, releases it, and the payments, sent again, run the fixed handler.
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
	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/migrate"
)

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	check(err)
	defer pool.Close()
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: "docs_repair"}) // idem's tables
	check(err)
	_, err = m.Up(ctx)
	check(err)
	idem, err := consumer.New(consumer.Config{
		Pool: pool, Schema: "docs_repair",
		Key: consumer.MetadataKey("payment_id"), // the payment, whatever message carries it
	})
	check(err)

	nc, err := natsgo.Connect(os.Getenv("NATS_URL"))
	check(err)
	defer nc.Close()
	topo := idemnats.Topology{AutoProvision: true}
	pub, err := idemnats.NewPublisher(nc, idemnats.PublisherConfig{Topology: topo})
	check(err)
	sub, err := idemnats.NewSubscriber(nc, idemnats.SubscriberConfig{Topology: topo, Durable: "docs-repair"})
	check(err)
	var deployed, settled, ran atomic.Int64 // deployed: 0 the bad build, 1 the fix
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	check(err)
	router.AddConsumerHandler("docs-repair", "docs-repair-payments", sub, func(msg *message.Message) error {
		if deployed.Load() == 0 {
			return consumer.Permanent(errors.New("currency CHF not supported")) // recorded as failed
		}
		ran.Add(1)
		return nil
	}).AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil {
				settled.Add(1)
			}
			return out, err
		}
	}, idem.Middleware)
	go func() { _ = router.Run(ctx) }()
	defer func() { _ = router.Close() }()
	<-router.Running()

	run := watermill.NewUUID() // new payments each run
	send := func(settledThen int64) {
		for i := range 3 {
			msg := message.NewMessage(watermill.NewUUID(), []byte(`{"currency":"CHF"}`))
			msg.Metadata.Set("payment_id", fmt.Sprintf("%s-%d", run, i))
			check(pub.Publish("docs-repair-payments", msg))
		}
		for settled.Load() < settledThen && ctx.Err() == nil {
			time.Sleep(50 * time.Millisecond)
		}
	}
	send(3)

	a, err := admin.New(admin.Config{Pool: pool, Schema: "docs_repair"})
	check(err)
	groups, err := a.ListGroups(ctx, admin.GroupFilter{Consumer: "docs-repair"}, admin.Page{})
	check(err)
	g := groups.Rows[0]
	fmt.Println(g.Consumer, g.Code, g.Count, g.Masked)
	act := admin.GroupAction{ID: g.ID, Through: g.LastSeen, DryRun: true}
	plan, err := a.ReleaseGroup(ctx, act)
	check(err)
	fmt.Println("a release would forget", plan.Rows, "keys")
	act.DryRun, act.AtMost = false, plan.Rows // no more than the operator saw
	act.Note = admin.Audit{Who: "ann", Why: "CHF support deployed"}
	done, err := a.ReleaseGroup(ctx, act)
	check(err)
	fmt.Println("released", done.Rows)

	deployed.Store(1)
	send(6) // the producer sends the payments again
	fmt.Println("the fixed handler ran", ran.Load(), "times")
}

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}
