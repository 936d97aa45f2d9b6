// Command migrations is docs/migrations.md's opening program: what a service
// does at start-up. It applies idem's migrations to schema docs_migrations
// (every instance may: an advisory lock applies each step once), applies them
// again (nothing left to do), and makes the consumer middleware, whose New
// checks that the schema is at the newest migration this build knows.
package main

import (
	"context"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/migrate"
)

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	check(err)
	defer pool.Close()

	m, err := migrate.New(migrate.Config{Pool: pool, Schema: "docs_migrations"}) // Schema: "idem" by default
	check(err)
	_, err = m.Up(ctx) // the first run applies every migration; a later one what is new
	check(err)
	applied, err := m.Up(ctx)
	check(err)
	fmt.Println("applied again:", len(applied))

	_, err = consumer.New(consumer.Config{Pool: pool, Schema: "docs_migrations"})
	check(err) // a schema that lacks a migration fails here, with code schema_missing
	fmt.Println("consumer.New accepts schema docs_migrations")
}

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}
