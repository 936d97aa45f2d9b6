package effects_test

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/migrate"
)

// exampleDB makes a migrated schema for an example; drop drops it and closes the
// pool.
func exampleDB() (pool *pgxpool.Pool, schema string, drop func()) {
	ctx := context.Background()
	schema = pgtest.NewSchemaName()
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	if err != nil {
		panic(err)
	}
	cfg.MaxConns = 2
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
	return pool, schema, func() {
		_, _ = pool.Exec(ctx, `DROP SCHEMA `+pgx.Identifier{schema}.Sanitize()+` CASCADE`)
		pool.Close()
	}
}

// A Dispatcher runs the Sender registered for each kind, with the same effect key
// on every attempt.
func ExampleDispatcher() {
	pool, schema, closeDB := exampleDB()
	defer closeDB()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	sent := make(chan string)
	email := effects.SenderFunc(func(ctx context.Context, d effects.Delivery) error {
		if d.Attempt == 1 {
			return fmt.Errorf("smtp: 421 try again later") // transient: retried with backoff
		}
		sent <- fmt.Sprintf("%s %s attempt %d: %s", d.Kind, d.Key, d.Attempt, d.Payload)
		return nil
	})
	d, err := effects.NewDispatcher(effects.Config{
		Pool:    pool,
		Schema:  schema,
		Senders: map[string]effects.Sender{"email": email},
		Backoff: effects.Backoff{Initial: 10 * time.Millisecond},
	})
	if err != nil {
		panic(err)
	}
	done := make(chan error)
	go func() { done <- d.Run(ctx) }()

	// The handler's transaction: the business write and the effect commit together.
	tx, err := pool.Begin(ctx)
	if err != nil {
		panic(err)
	}
	_, err = effects.Enqueue(effects.WithScope(ctx, effects.Scope{Schema: schema}), tx,
		effects.Effect{Kind: "email", Key: "receipt:pay_789", Payload: []byte(`{"to":"ann@example.com"}`)})
	if err != nil {
		panic(err)
	}
	if err := tx.Commit(ctx); err != nil {
		panic(err)
	}

	fmt.Println(<-sent)
	cancel()
	fmt.Println("Run:", <-done)
	// Output:
	// email receipt:pay_789 attempt 2: {"to":"ann@example.com"}
	// Run: <nil>
}
