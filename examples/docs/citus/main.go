// Command citus is docs/citus.md's opening program: a NATS consumer on a Citus
// coordinator. idem's tables are distributed by tenant (migrate in Citus mode),
// and so are the business tables, colocated with them: accounts, and a ledger
// whose keys and foreign key include the tenant. Each tenant's payment is
// delivered twice (its first ack is lost); it is booked once, and its receipt,
// an effect, is sent once by a Dispatcher that serves every tenant.
package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"sync"
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

const schema = "docs_citus"

var tenants = []string{"acme", "globex", "initech", "umbrella"}

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool, err := pgxpool.New(ctx, os.Getenv("IDEM_CITUS_URL")) // the coordinator
	check(err)
	defer pool.Close()
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: schema, Citus: true})
	check(err)
	_, err = m.Up(ctx) // idem's inbox and effects, distributed by tenant
	check(err)
	// Your tables: the tenant in every primary, unique and foreign key, each
	// distributed by tenant and colocated with idem's inbox.
	_, err = pool.Exec(ctx, `
		CREATE TABLE IF NOT EXISTS docs_citus.accounts (
			tenant text NOT NULL, account text NOT NULL,
			PRIMARY KEY (tenant, account));
		CREATE TABLE IF NOT EXISTS docs_citus.ledger (
			tenant text NOT NULL, payment text NOT NULL, account text NOT NULL, amount numeric NOT NULL,
			PRIMARY KEY (tenant, payment),
			FOREIGN KEY (tenant, account) REFERENCES docs_citus.accounts (tenant, account))`)
	check(err)
	for _, table := range []string{"docs_citus.accounts", "docs_citus.ledger"} {
		_, err = pool.Exec(ctx, `SELECT create_distributed_table($1, 'tenant', colocate_with => 'docs_citus.inbox')
			WHERE NOT EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = $1::regclass)`, table)
		check(err)
	}
	for _, tenant := range tenants {
		_, err = pool.Exec(ctx, `INSERT INTO docs_citus.accounts VALUES ($1, 'main') ON CONFLICT DO NOTHING`, tenant)
		check(err)
	}

	ids := map[string]string{} // this run's payments, by tenant
	for _, tenant := range tenants {
		ids[tenant] = watermill.NewUUID()
	}

	// A Dispatcher without a Tenant sends the effects of every tenant.
	var mu sync.Mutex
	receipts := map[string]int{} // this run's receipts sent, by tenant
	d, err := effects.NewDispatcher(effects.Config{
		Pool: pool, Schema: schema,
		Senders: map[string]effects.Sender{
			"receipt": effects.SenderFunc(func(ctx context.Context, d effects.Delivery) error {
				mu.Lock()
				defer mu.Unlock()
				if d.Key == "receipt:"+ids[d.Tenant] {
					receipts[d.Tenant]++ // an email in a service, with d.Key as its Message-ID
				}
				return nil
			}),
		},
	})
	check(err)
	go func() { _ = d.Run(ctx) }()

	// The consumer names the tenant of each message: its inbox key, ledger row
	// and effect commit in one transaction, on the worker that holds the tenant.
	idem, err := consumer.New(consumer.Config{Pool: pool, Schema: schema, Tenant: consumer.MetadataKey("tenant")})
	check(err)
	nc, err := natsgo.Connect(os.Getenv("NATS_URL"))
	check(err)
	defer nc.Close()
	topo := idemnats.Topology{AutoProvision: true}
	pub, err := idemnats.NewPublisher(nc, idemnats.PublisherConfig{Topology: topo})
	check(err)
	sub, err := idemnats.NewSubscriber(nc, idemnats.SubscriberConfig{
		Topology: topo, Durable: "docs-citus",
		NakDelay: func(uint64) time.Duration { return 100 * time.Millisecond },
	})
	check(err)
	var deliveries atomic.Int64
	acked := sync.Map{} // payments whose first ack was lost
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	check(err)
	router.AddConsumerHandler("docs-citus", "docs-citus-payments", sub, func(msg *message.Message) error {
		ctx, tx := msg.Context(), consumer.Tx(msg.Context())
		tenant := msg.Metadata.Get("tenant")
		_, err := tx.Exec(ctx, `INSERT INTO docs_citus.ledger VALUES ($1, $2, 'main', 42)`, tenant, msg.UUID)
		if err != nil {
			return err
		}
		_, err = effects.Enqueue(ctx, tx, effects.Effect{Kind: "receipt", Key: "receipt:" + msg.UUID, Payload: msg.Payload})
		return err
	}).AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			deliveries.Add(1)
			out, err := h(msg)
			if _, again := acked.LoadOrStore(msg.UUID, true); err == nil && !again {
				return nil, errors.New("ack lost") // committed, but JetStream delivers it again
			}
			return out, err
		}
	}, idem.Middleware)
	go func() { _ = router.Run(ctx) }()
	defer func() { _ = router.Close() }()
	<-router.Running()

	for _, tenant := range tenants {
		msg := message.NewMessage(ids[tenant], []byte(`{"amount":42}`))
		msg.Metadata.Set("tenant", tenant)
		check(pub.Publish("docs-citus-payments", msg))
	}
	sent := func() (n int) {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range receipts {
			n += c
		}
		return n
	}
	for (deliveries.Load() < 8 || sent() < 4) && ctx.Err() == nil {
		time.Sleep(50 * time.Millisecond)
	}
	for _, tenant := range tenants {
		var rows int
		check(pool.QueryRow(ctx, `SELECT count(*) FROM docs_citus.ledger WHERE tenant = $1 AND payment = $2`, tenant, ids[tenant]).Scan(&rows))
		mu.Lock()
		fmt.Printf("%s: ledger rows %d, receipts sent %d\n", tenant, rows, receipts[tenant])
		mu.Unlock()
	}
	fmt.Printf("deliveries %d\n", deliveries.Load())
}

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}
