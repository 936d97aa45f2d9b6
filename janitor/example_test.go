package janitor_test

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/janitor"
	"github.com/idemkit/idem/migrate"
)

// The janitor deletes inbox rows past their retention. A service runs it with
// Run(ctx), one pass a minute; RunOnce is one pass.
func ExampleJanitor_RunOnce() {
	pool, schema, cleanup := exampleDB()
	defer cleanup()
	ctx := context.Background()

	idem, err := consumer.New(consumer.Config{
		Name: "payments", Pool: pool, Schema: schema,
		Retention: 7 * 24 * time.Hour, // longer than the broker can redeliver
	})
	if err != nil {
		panic(err)
	}
	handler := idem.Middleware(func(msg *message.Message) ([]*message.Message, error) { return nil, nil })
	if _, err := handler(message.NewMessage("pay_1", []byte(`{}`))); err != nil {
		panic(err)
	}

	j, err := janitor.New(janitor.Config{Pool: pool, Schema: schema})
	if err != nil {
		panic(err)
	}
	st, err := j.RunOnce(ctx)
	if err != nil {
		panic(err)
	}
	fmt.Println("today, inbox rows deleted:", st.InboxDeleted)

	aWeekPasses(pool, schema)
	if st, err = j.RunOnce(ctx); err != nil {
		panic(err)
	}
	fmt.Println("a week later, inbox rows deleted:", st.InboxDeleted)
	// Output:
	// today, inbox rows deleted: 0
	// a week later, inbox rows deleted: 1
}

// exampleDB is the example's test plumbing: a pool on the test database
// (DATABASE_URL) with a fresh schema, migrated. cleanup drops the schema.
func exampleDB() (pool *pgxpool.Pool, schema string, cleanup func()) {
	ctx := context.Background()
	schema = pgtest.NewSchemaName()
	pool, err := pgxpool.New(ctx, pgtest.URL())
	if err != nil {
		panic(err)
	}
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: schema})
	if err != nil {
		panic(err)
	}
	if _, err := m.Up(ctx); err != nil {
		panic(err)
	}
	return pool, schema, func() {
		_, _ = pool.Exec(ctx, `DROP SCHEMA `+pgx.Identifier{schema}.Sanitize()+` CASCADE`)
		pool.Close()
	}
}

// aWeekPasses stands in for the time passing: it moves every inbox row's expiry
// eight days back.
func aWeekPasses(pool *pgxpool.Pool, schema string) {
	_, err := pool.Exec(context.Background(), `UPDATE `+pgx.Identifier{schema, "inbox"}.Sanitize()+
		` SET received_at = received_at - interval '8 days', expires_at = expires_at - interval '8 days'`)
	if err != nil {
		panic(err)
	}
}
