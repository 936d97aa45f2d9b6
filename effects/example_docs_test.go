package effects_test

import (
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/effects"
)

// docDispatcherBehindPgBouncer is the guide's snippet (docs/database.md) of a
// dispatcher whose pool goes through PgBouncer and whose LISTEN connection does
// not: compiled with the tests, not run.
func docDispatcherBehindPgBouncer(pool *pgxpool.Pool, senders map[string]effects.Sender) (*effects.Dispatcher, error) {
	direct, _ := pgx.ParseConfig("postgres://app@db:5432/app") // not the pooler
	d, err := effects.NewDispatcher(effects.Config{Pool: pool, ListenConnConfig: direct, Senders: senders})
	return d, err
}

var _ = docDispatcherBehindPgBouncer
