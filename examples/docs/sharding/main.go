// Command sharding is docs/sharding.md's opening program: a NATS consumer over
// a shard map of two shards, routed by the tenant in each message's metadata.
// The two shards are two schemas of DATABASE_URL here, two Postgres servers in a
// service. Each tenant's inbox rows and orders land on its shard.
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
	"github.com/idemkit/idem/migrate"
	"github.com/idemkit/idem/shard"
)

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	check(err)
	defer pool.Close()
	shards := &shard.Map{
		Shards: []shard.Shard{
			{Name: "a", Pool: pool, Schema: "docs_shard_a"}, // a pool of its own in a service
			{Name: "b", Pool: pool, Schema: "docs_shard_b"},
		},
		Table: map[string]string{"bigcorp": "b"}, // pinned; the others by hash
	}
	check(shards.Validate())
	m, err := migrate.New(migrate.Config{Shards: shards})
	check(err)
	_, err = m.Up(ctx) // every shard
	check(err)
	for _, s := range shards.Shards {
		_, err = pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+s.Schema+`.orders (id text, tenant text)`)
		check(err)
	}
	idem, err := consumer.New(consumer.Config{Shards: shards, Tenant: consumer.MetadataKey("tenant")})
	check(err)

	nc, err := natsgo.Connect(os.Getenv("NATS_URL"))
	check(err)
	defer nc.Close()
	topo := idemnats.Topology{AutoProvision: true}
	pub, err := idemnats.NewPublisher(nc, idemnats.PublisherConfig{Topology: topo})
	check(err)
	sub, err := idemnats.NewSubscriber(nc, idemnats.SubscriberConfig{Topology: topo, Durable: "docs-sharding"})
	check(err)
	var settled atomic.Int64
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	check(err)
	router.AddConsumerHandler("docs-sharding", "docs-sharding-orders", sub, func(msg *message.Message) error {
		ctx := msg.Context()
		s, err := shards.Pick(msg.Metadata.Get("tenant")) // the shard idem routed the message to
		if err != nil {
			return err
		}
		_, err = consumer.Tx(ctx).Exec(ctx, // a transaction on that shard
			`INSERT INTO `+s.Schema+`.orders VALUES ($1, $2)`, msg.UUID, msg.Metadata.Get("tenant"))
		return err
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

	var ids []string // this run's orders
	for _, tenant := range []string{"acme", "globex", "initech", "bigcorp"} {
		msg := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
		ids = append(ids, msg.UUID)
		msg.Metadata.Set("tenant", tenant)
		check(pub.Publish("docs-sharding-orders", msg))
	}
	for settled.Load() < 4 && ctx.Err() == nil {
		time.Sleep(50 * time.Millisecond)
	}
	for _, tenant := range []string{"acme", "globex", "initech", "bigcorp"} {
		var on []string
		for _, s := range shards.Shards {
			var n int
			check(pool.QueryRow(ctx, `SELECT count(*) FROM `+s.Schema+`.orders WHERE tenant = $1 AND id = ANY($2)`, tenant, ids).Scan(&n))
			if n > 0 {
				on = append(on, s.Name)
			}
		}
		fmt.Println(tenant, "orders on shard", on)
	}
}

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}
