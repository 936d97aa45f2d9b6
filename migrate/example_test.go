package migrate_test

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/migrate"
)

// A service migrates its idem schema at start-up. Up applies what is missing,
// under an advisory lock, so every instance may call it; a second call applies
// nothing.
func ExampleMigrator_Up() {
	pool, schema, cleanup := examplePool()
	defer cleanup()
	ctx := context.Background()

	m, err := migrate.New(migrate.Config{Pool: pool, Schema: schema}) // Schema: "idem" by default
	if err != nil {
		panic(err)
	}
	applied, err := m.Up(ctx)
	if err != nil {
		panic(err)
	}
	fmt.Println("applied all:", len(applied) == len(migrate.Migrations()))
	applied, err = m.Up(ctx)
	if err != nil {
		panic(err)
	}
	fmt.Println("applied again:", len(applied))
	// Output:
	// applied all: true
	// applied again: 0
}

// examplePool is the example's test plumbing: a pool on the test database
// (DATABASE_URL) and a fresh schema name. cleanup drops the schema.
func examplePool() (pool *pgxpool.Pool, schema string, cleanup func()) {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, pgtest.URL())
	if err != nil {
		panic(err)
	}
	schema = pgtest.NewSchemaName()
	return pool, schema, func() {
		_, _ = pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+pgx.Identifier{schema}.Sanitize()+` CASCADE`)
		pool.Close()
	}
}
