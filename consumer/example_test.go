package consumer_test

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/migrate"
)

// A payment handler behind the idem middleware. The same message delivered three
// times writes one ledger row and one receipt effect.
func Example() {
	ctx := context.Background()
	schema := pgtest.NewSchemaName() // use "idem" (the default) in your service
	pool, _ := pgxpool.New(ctx, pgtest.URL())
	defer pool.Close()
	defer func() { _, _ = pool.Exec(ctx, `DROP SCHEMA `+schema+` CASCADE`) }()

	m, _ := migrate.New(migrate.Config{Pool: pool, Schema: schema})
	if _, err := m.Up(ctx); err != nil {
		fmt.Println(err)
		return
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE `+schema+`.ledger (payment text, amount int)`); err != nil {
		fmt.Println(err)
		return
	}

	idem, _ := consumer.New(consumer.Config{Name: "payments", Pool: pool, Schema: schema})
	handler := idem.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx := consumer.Tx(ctx)
		if _, err := tx.Exec(ctx, `INSERT INTO `+schema+`.ledger VALUES ($1, 10)`, msg.UUID); err != nil {
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
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+schema+`.ledger`).Scan(&ledger); err != nil {
		fmt.Println(err)
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+schema+`.effects`).Scan(&emails); err != nil {
		fmt.Println(err)
	}
	fmt.Println("ledger rows:", ledger, "email effects:", emails)
	// Output: ledger rows: 1 email effects: 1
}
