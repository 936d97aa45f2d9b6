package chaos_test

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/chaos"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/migrate"
)

// A consumer behind a misbehaving broker: every message comes with extra copies
// and is delivered again after its ack, in a shuffled order. The Auditor then
// checks the ledger: every payment committed once, none lost.
func Example() {
	pool, schema, cleanup := exampleDB(`CREATE TABLE ledger (payment text, amount int)`)
	defer cleanup()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	broker := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, watermill.NopLogger{})
	sub, err := chaos.NewSubscriber(broker, chaos.Config{
		Seed:                 42,              // same seed, same faults on the same messages
		DuplicateProbability: 1, MaxCopies: 2, // extra copies next to the original
		RedeliverProbability: 1, RedeliverDelay: 20 * time.Millisecond, // delivered again after it was acked
		ReorderWindow: 4, // shuffled within 4 messages
		MaxDelay:      5 * time.Millisecond,
	})
	if err != nil {
		panic(err)
	}
	idem, err := consumer.New(consumer.Config{Name: "payments", Pool: pool, Schema: schema})
	if err != nil {
		panic(err)
	}
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		panic(err)
	}
	router.AddMiddleware(idem.Middleware)
	router.AddConsumerHandler("payments", "payments", sub, func(msg *message.Message) error {
		_, err := consumer.Tx(msg.Context()).Exec(msg.Context(), `INSERT INTO ledger VALUES ($1, 10)`, msg.UUID)
		return err
	})
	go func() { _ = router.Run(ctx) }() // its error is Close's
	defer func() { _ = router.Close() }()
	<-router.Running()

	var ids []string
	for i := range 20 {
		msg := message.NewMessage(fmt.Sprintf("pay_%02d", i), []byte(`{"amount":10}`))
		ids = append(ids, msg.UUID)
		if err := broker.Publish("payments", msg); err != nil {
			panic(err)
		}
	}

	auditor, err := chaos.NewAuditor(chaos.AuditorConfig{Pool: pool, Schema: schema})
	if err != nil {
		panic(err)
	}
	rep, err := auditor.Settled(ctx, chaos.AuditQuery{
		Consumer:     "payments",
		ExpectedKeys: ids,
		BusinessSQL:  `SELECT payment, count(*) FROM ledger GROUP BY 1`, // the ground truth
	})
	if err != nil {
		panic(err)
	}
	rep.Deliveries = sub.Stats().Delivered // read once the run has settled
	fmt.Println("ok:", rep.OK(), "once:", rep.CommittedOnce, "twice:", rep.CommittedTwice, "lost:", rep.Lost)
	fmt.Println("inbox completed:", rep.InboxCompleted, "duplicates delivered:", rep.DuplicatesDelivered() > 0)
	// Output:
	// ok: true once: 20 twice: 0 lost: 0
	// inbox completed: 20 duplicates delivered: true
}

// exampleDB is the example's test plumbing: a pool on the test database
// (DATABASE_URL) whose search_path is a fresh schema, migrated, with the
// business tables of ddl. cleanup drops the schema.
func exampleDB(ddl ...string) (pool *pgxpool.Pool, schema string, cleanup func()) {
	ctx := context.Background()
	schema = pgtest.NewSchemaName()
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	if err != nil {
		panic(err)
	}
	cfg.MaxConns = 4
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	if pool, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
		panic(err)
	}
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: schema})
	if err != nil {
		panic(err)
	}
	if _, err := m.Up(ctx); err != nil {
		panic(err)
	}
	for _, q := range ddl {
		if _, err := pool.Exec(ctx, q); err != nil {
			panic(err)
		}
	}
	return pool, schema, func() {
		_, _ = pool.Exec(ctx, `DROP SCHEMA `+pgx.Identifier{schema}.Sanitize()+` CASCADE`)
		pool.Close()
	}
}
