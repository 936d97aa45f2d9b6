package shard_test

import (
	"errors"
	"net/http"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/httpidem"
	"github.com/idemkit/idem/janitor"
	"github.com/idemkit/idem/migrate"
	"github.com/idemkit/idem/shard"
)

// docConfigsOverOneMap is the guide's snippet (docs/sharding.md) of the configs
// over one map, side by side: compiled with the tests, not run. Each package's
// Shard tests run them on three clusters.
func docConfigsOverOneMap(poolEU1, poolEU2, poolUS1 *pgxpool.Pool, senders map[string]effects.Sender,
	tenantOf func(*http.Request) (string, error),
) error {
	m := &shard.Map{
		Shards: []shard.Shard{
			{Name: "eu-1", Pool: poolEU1}, // schema "idem"
			{Name: "eu-2", Pool: poolEU2},
			{Name: "us-1", Pool: poolUS1, Schema: "idem"},
		},
		// Optional: tenants pinned to a shard, over the hash (and over Route).
		Table: map[string]string{"bigcorp": "us-1"},
	}
	if err := m.Validate(); err != nil {
		return err // invalid_config, invalid_schema
	}

	_, errM := migrate.New(migrate.Config{Shards: m}) // Up migrates every shard
	_, errC := consumer.New(consumer.Config{Shards: m, Tenant: consumer.MetadataKey("tenant")})
	_, errE := effects.NewDispatcher(effects.Config{Shards: m, Senders: senders})
	_, errJ := janitor.New(janitor.Config{Shards: m})
	_, errH := httpidem.New(httpidem.Config{Shards: m, Tenant: tenantOf})
	return errors.Join(errM, errC, errE, errJ, errH)
}

var _ = docConfigsOverOneMap
