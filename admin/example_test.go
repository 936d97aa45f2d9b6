package admin_test

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/migrate"
)

// A bad deploy failed three payments permanently. The operator reads the failure
// group, checks what a retry would touch, and releases it: the keys are forgotten
// and their redeliveries run the fixed handler.
func Example() {
	pool, schema, cleanup := exampleDB()
	defer cleanup()
	ctx := context.Background()

	idem, err := consumer.New(consumer.Config{Name: "payments", Pool: pool, Schema: schema})
	if err != nil {
		panic(err)
	}
	broken := idem.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		return nil, consumer.Permanent(fmt.Errorf("currency %q not supported", msg.UUID))
	})
	for _, id := range []string{"pay_1", "pay_2", "pay_3"} {
		if _, err := broken(message.NewMessage(id, []byte(`{"currency":"CHF"}`))); err != nil {
			panic(err) // a permanent failure is recorded and acked: no error here
		}
	}

	a, err := admin.New(admin.Config{Pool: pool, Schema: schema})
	if err != nil {
		panic(err)
	}
	groups, err := a.ListGroups(ctx, admin.GroupFilter{Consumer: "payments"}, admin.Page{})
	if err != nil {
		panic(err)
	}
	g := groups.Rows[0]
	fmt.Println(g.Consumer, g.Code, g.Count, g.Masked)

	act := admin.GroupAction{ID: g.ID, Through: g.LastSeen, DryRun: true}
	plan, err := a.ReleaseGroup(ctx, act)
	if err != nil {
		panic(err)
	}
	fmt.Println("a release would forget", plan.Rows, "keys:", plan.Keys)

	act.DryRun, act.AtMost = false, plan.Rows // no more than the operator saw
	act.Note = admin.Audit{Who: "ann", Why: "CHF support deployed"}
	done, err := a.ReleaseGroup(ctx, act)
	if err != nil {
		panic(err)
	}
	fmt.Println("released", done.Rows)

	fixed := idem.Middleware(func(msg *message.Message) ([]*message.Message, error) { return nil, nil })
	for _, id := range []string{"pay_1", "pay_2", "pay_3"} { // the broker redelivers
		if _, err := fixed(message.NewMessage(id, []byte(`{"currency":"CHF"}`))); err != nil {
			fmt.Println(err)
		}
	}
	st, err := a.Stats(ctx)
	if err != nil {
		panic(err)
	}
	for _, c := range st.Consumers {
		fmt.Println(c.Consumer, "completed:", c.Completed, "failed:", c.Failed)
	}
	// Output:
	// payments permanent 3 permanent: currency "…" not supported
	// a release would forget 3 keys: [pay_1 pay_2 pay_3]
	// released 3
	// payments completed: 3 failed: 0
}

// exampleDB is the example's test plumbing: a pool on the test database
// (DATABASE_URL) with a fresh schema, migrated. cleanup drops the schema.
func exampleDB() (pool *pgxpool.Pool, schema string, cleanup func()) {
	ctx := context.Background()
	schema = pgtest.NewSchemaName()
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	if err != nil {
		panic(err)
	}
	cfg.MaxConns = 4
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
