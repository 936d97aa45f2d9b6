package consumer_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/migrate"
)

// A payment handler behind the idem middleware. The same message delivered three
// times writes one ledger row and one receipt effect.
func Example() {
	pool, schema, cleanup := exampleDB(`CREATE TABLE ledger (payment text, amount int)`)
	defer cleanup()
	ctx := context.Background()

	idem, err := consumer.New(consumer.Config{Name: "payments", Pool: pool, Schema: schema})
	if err != nil {
		panic(err)
	}
	handler := idem.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx := consumer.Tx(ctx) // the transaction the inbox claim is in
		if _, err := tx.Exec(ctx, `INSERT INTO ledger VALUES ($1, 10)`, msg.UUID); err != nil {
			return nil, err
		}
		_, err := effects.Enqueue(ctx, tx, effects.Effect{
			Kind: "email", Key: "receipt:" + msg.UUID, Payload: []byte(`{"to":"ada@example.com"}`),
		})
		return nil, err
	})

	for range 3 { // a redelivery and a producer retry
		if _, err := handler(message.NewMessage("pay_789", []byte(`{"amount":10}`))); err != nil {
			fmt.Println(err)
		}
	}
	var ledger, emails int
	if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM ledger), (SELECT count(*) FROM effects)`).
		Scan(&ledger, &emails); err != nil {
		panic(err)
	}
	fmt.Println("ledger rows:", ledger, "email effects:", emails)
	// Output: ledger rows: 1 email effects: 1
}

// A business key makes two messages with different UUIDs one operation: the
// producer sent the same payment twice, each time with a fresh message ID.
func ExampleBusinessKey() {
	pool, schema, cleanup := exampleDB(`CREATE TABLE ledger (payment text, amount int)`)
	defer cleanup()
	ctx := context.Background()

	idem, err := consumer.New(consumer.Config{
		Name: "payments", Pool: pool, Schema: schema,
		Key: consumer.BusinessKey(func(payload []byte) (string, error) {
			var p struct{ PaymentID string }
			if err := json.Unmarshal(payload, &p); err != nil || p.PaymentID == "" {
				return "", fmt.Errorf("no payment ID: %w", err)
			}
			return "payment:" + p.PaymentID, nil
		}),
	})
	if err != nil {
		panic(err)
	}
	handler := idem.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		_, err := consumer.Tx(msg.Context()).Exec(msg.Context(),
			`INSERT INTO ledger VALUES ($1, 10)`, msg.UUID)
		return nil, err
	})

	for range 2 {
		msg := message.NewMessage(consumer.NewUUID(), []byte(`{"PaymentID":"pay_789","Amount":10}`)) // a new UUID each time
		if _, err := handler(msg); err != nil {
			fmt.Println(err)
		}
	}
	var ledger int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM ledger`).Scan(&ledger); err != nil {
		panic(err)
	}
	fmt.Println("ledger rows:", ledger)
	// Output: ledger rows: 1
}

// A tenant scope makes the same key from two tenants two operations, and keeps
// a redelivery within one tenant a duplicate.
func ExampleMetadataKey_tenant() {
	pool, schema, cleanup := exampleDB(`CREATE TABLE orders (tenant text, id text)`)
	defer cleanup()
	ctx := context.Background()

	idem, err := consumer.New(consumer.Config{
		Name: "orders", Pool: pool, Schema: schema,
		Key:    consumer.MetadataKey("order_id"),
		Tenant: consumer.MetadataKey("tenant"),
	})
	if err != nil {
		panic(err)
	}
	handler := idem.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		_, err := consumer.Tx(msg.Context()).Exec(msg.Context(), `INSERT INTO orders VALUES ($1, $2)`,
			msg.Metadata.Get("tenant"), msg.Metadata.Get("order_id"))
		return nil, err
	})

	for _, tenant := range []string{"acme", "globex", "acme"} {
		msg := message.NewMessage(consumer.NewUUID(), []byte(`{}`))
		msg.Metadata.Set("tenant", tenant)
		msg.Metadata.Set("order_id", "ord_1")
		if _, err := handler(msg); err != nil {
			fmt.Println(err)
		}
	}
	rows, err := pool.Query(ctx, `SELECT tenant, id FROM orders ORDER BY tenant`)
	if err != nil {
		panic(err)
	}
	defer rows.Close()
	for rows.Next() {
		var tenant, id string
		if err := rows.Scan(&tenant, &id); err != nil {
			panic(err)
		}
		fmt.Println(tenant, id)
	}
	// Output:
	// acme ord_1
	// globex ord_1
}

// A permanent failure is recorded in the inbox and acked (AckOnPermanent, the
// default); its redelivery replays the recorded failure without running the
// handler again. A transient error rolls back and nacks, and records nothing.
func ExamplePermanent() {
	pool, schema, cleanup := exampleDB()
	defer cleanup()
	ctx := context.Background()

	idem, err := consumer.New(consumer.Config{Name: "payments", Pool: pool, Schema: schema})
	if err != nil {
		panic(err)
	}
	runs := 0
	handler := idem.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		runs++
		if string(msg.Payload) == "db busy" {
			return nil, errors.New("database busy") // transient: nacked, retried
		}
		return nil, consumer.Permanent(errors.New("card declined"))
	})

	for range 2 {
		_, err := handler(message.NewMessage("pay_1", []byte("declined")))
		fmt.Println("declined: err =", err)
	}
	_, err = handler(message.NewMessage("pay_2", []byte("db busy")))
	fmt.Println("busy: err =", err)

	var failed, recorded int
	if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE state = 'failed'), count(*) FROM inbox`).
		Scan(&failed, &recorded); err != nil {
		panic(err)
	}
	fmt.Println("handler runs:", runs, "failed rows:", failed, "inbox rows:", recorded)
	// Output:
	// declined: err = <nil>
	// declined: err = <nil>
	// busy: err = database busy
	// handler runs: 2 failed rows: 1 inbox rows: 1
}

// exampleDB is the examples' test plumbing: a pool on the test database
// (DATABASE_URL) whose search_path is a fresh schema, migrated, with the
// business tables of ddl. A service migrates the default "idem" schema once
// (migrate.Migrator.Up or `idem migrate up`). cleanup drops the schema.
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
