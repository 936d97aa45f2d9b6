// Command database is docs/database.md's opening program: a consumer whose
// pool goes through PgBouncer in transaction pooling mode (PGBOUNCER_URL).
// PgBouncer refuses a search_path startup parameter, so the schema is named in
// idem's config and in the handler's SQL; pgx's exec query mode replaces the
// prepared statements PgBouncer 1.18 cannot follow.
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
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	natsgo "github.com/nats-io/nats.go"

	idemnats "github.com/idemkit/idem/adapters/nats"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/migrate"
)

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg, err := pgxpool.ParseConfig(os.Getenv("PGBOUNCER_URL"))
	check(err)
	cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec // or default_query_exec_mode=exec in the URL

	refused := cfg.Copy() // what not to do: a search_path startup parameter
	refused.ConnConfig.RuntimeParams["search_path"] = "docs_database"
	if bad, err := pgxpool.NewWithConfig(ctx, refused); err == nil {
		err = bad.Ping(ctx)
		bad.Close()
		fmt.Println("search_path startup parameter refused:", err != nil && strings.Contains(err.Error(), "unsupported startup parameter"))
	}

	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	check(err)
	defer pool.Close()
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: "docs_database"}) // the schema, in idem's config
	check(err)
	_, err = m.Up(ctx)
	check(err)
	_, err = pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS docs_database.orders (id text)`) // and in your SQL
	check(err)
	idem, err := consumer.New(consumer.Config{Pool: pool, Schema: "docs_database"})
	check(err)

	nc, err := natsgo.Connect(os.Getenv("NATS_URL"))
	check(err)
	defer nc.Close()
	topo := idemnats.Topology{AutoProvision: true}
	pub, err := idemnats.NewPublisher(nc, idemnats.PublisherConfig{Topology: topo})
	check(err)
	sub, err := idemnats.NewSubscriber(nc, idemnats.SubscriberConfig{Topology: topo, Durable: "docs-database"})
	check(err)
	id := watermill.NewUUID()
	var done atomic.Bool
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	check(err)
	router.AddConsumerHandler("docs-database", "docs-database-orders", sub, func(msg *message.Message) error {
		_, err := consumer.Tx(msg.Context()).Exec(msg.Context(), `INSERT INTO docs_database.orders VALUES ($1)`, msg.UUID)
		if err == nil && msg.UUID == id {
			done.Store(true)
		}
		return err
	}).AddMiddleware(idem.Middleware)
	go func() { _ = router.Run(ctx) }()
	defer func() { _ = router.Close() }()
	<-router.Running()

	check(pub.Publish("docs-database-orders", message.NewMessage(id, []byte(`{}`))))
	for !done.Load() && ctx.Err() == nil {
		time.Sleep(50 * time.Millisecond)
	}
	var rows int
	check(pool.QueryRow(ctx, `SELECT count(*) FROM docs_database.orders WHERE id = $1`, id).Scan(&rows))
	fmt.Println("through PgBouncer: order rows", rows)
}

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}
