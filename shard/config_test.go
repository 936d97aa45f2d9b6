package shard_test

import (
	"net/http"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/httpidem"
	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/janitor"
	"github.com/idemkit/idem/migrate"
	"github.com/idemkit/idem/shard"
)

// Every config takes either Pool and Schema (one database) or Shards, never both,
// and a config with Shards passes once its defaults are filled in too.
func TestConfigsTakePoolOrShards(t *testing.T) {
	t.Parallel()
	m := &shard.Map{Shards: shards(t, "s1", "s2")}
	p := m.Shards[0].Pool
	tenant := func(*message.Message) (string, error) { return "t", nil }
	httpTenant := func(*http.Request) (string, error) { return "t", nil }
	senders := map[string]effects.Sender{"k": effects.SenderFunc(nil)}

	type validator interface{ Validate() error }
	for name, tc := range map[string]struct {
		ok, defaulted validator
		pool          validator
		schema        validator
		badMap        validator
		special       validator // a rule of its own with a map, or nil
	}{
		"consumer": {
			consumer.Config{Shards: m, Tenant: tenant},
			consumer.Config{Shards: m, Tenant: tenant}.WithDefaults(),
			consumer.Config{Shards: m, Tenant: tenant, Pool: p},
			consumer.Config{Shards: m, Tenant: tenant, Schema: "idem"},
			consumer.Config{Shards: &shard.Map{}, Tenant: tenant},
			consumer.Config{Shards: m}, // no Tenant to route by
		},
		"effects": {
			effects.Config{Shards: m, Senders: senders},
			effects.Config{Shards: m, Senders: senders}.WithDefaults(),
			effects.Config{Shards: m, Senders: senders, Pool: p},
			effects.Config{Shards: m, Senders: senders, Schema: "x"},
			effects.Config{Shards: &shard.Map{}, Senders: senders},
			effects.Config{Shards: m, Senders: senders, ListenConnConfig: p.Config().ConnConfig},
		},
		"httpidem": {
			httpidem.Config{Shards: m, Tenant: httpTenant},
			httpidem.Config{Shards: m, Tenant: httpTenant}.WithDefaults(),
			httpidem.Config{Shards: m, Tenant: httpTenant, Pool: p},
			httpidem.Config{Shards: m, Tenant: httpTenant, Schema: "x"},
			httpidem.Config{Shards: &shard.Map{}, Tenant: httpTenant},
			httpidem.Config{Shards: m, Unscoped: true},
		},
		"janitor": {
			janitor.Config{Shards: m},
			janitor.Config{Shards: m}.WithDefaults(),
			janitor.Config{Shards: m, Pool: p},
			janitor.Config{Shards: m, Schema: "x"},
			janitor.Config{Shards: &shard.Map{}},
			nil,
		},
		"migrate": {
			migrate.Config{Shards: m},
			migrate.Config{Shards: m}.WithDefaults(),
			migrate.Config{Shards: m, Pool: p},
			migrate.Config{Shards: m, Schema: "x"},
			migrate.Config{Shards: &shard.Map{}},
			nil,
		},
		"admin": {
			admin.Config{Shards: m},
			admin.Config{Shards: m}.WithDefaults(),
			admin.Config{Shards: m, Pool: p},
			admin.Config{Shards: m, Schema: "x"},
			admin.Config{Shards: &shard.Map{}},
			nil,
		},
	} {
		require.NoError(t, tc.ok.Validate(), name)
		require.NoError(t, tc.defaulted.Validate(), "%s: WithDefaults", name)
		for what, v := range map[string]validator{"pool": tc.pool, "schema": tc.schema, "bad map": tc.badMap, "special": tc.special} {
			if v == nil {
				continue
			}
			err := v.Validate()
			require.ErrorIs(t, err, errcode.ErrInvalidConfig, "%s: %s", name, what)
			require.Equal(t, "invalid_config", errcode.Code(err), "%s: %s", name, what)
		}
	}
}
