package consumer_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/migrate"
	"github.com/idemkit/idem/shard"
)

// requireRefused checks that New refused schema with code schema_missing, naming
// the schema, the command, and want.
func requireRefused(t *testing.T, err error, schema, want string) {
	t.Helper()
	require.ErrorIs(t, err, consumer.ErrSchemaMissing)
	require.Equal(t, "schema_missing", inbox.Code(err))
	require.Contains(t, err.Error(), fmt.Sprintf("schema %q", schema))
	require.Contains(t, err.Error(), "`idem migrate up --schema "+schema+"`")
	require.Contains(t, err.Error(), want)
}

// missingFrom is how the check names the versions from v to the newest.
func missingFrom(v int) string {
	var vs []string
	for ; v <= len(migrate.Migrations()); v++ {
		vs = append(vs, fmt.Sprintf("%03d", v))
	}
	return strings.Join(vs, ", ") + " not applied"
}

// New checks the schema once, at start: an empty schema and one at an older
// migration level are refused before any message; SkipSchemaCheck skips the check.
func TestNewChecksTheSchema(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.Setup(t, pgtest.Options{NoMigrate: true})
	start := func(skip bool) error {
		c, err := consumer.New(consumer.Config{Name: "x", Pool: pool, Schema: schema, SkipSchemaCheck: skip})
		if err == nil {
			require.NoError(t, c.Close())
		}
		return err
	}
	requireRefused(t, start(false), schema, "holds none of idem's tables")
	pgtest.ApplyMigrations(t, pool, 1, 5)
	requireRefused(t, start(false), schema, "is at migration 005")
	requireRefused(t, start(false), schema, missingFrom(6))
	require.NoError(t, start(true), "SkipSchemaCheck")
	pgtest.ApplyMigrations(t, pool, 6, len(migrate.Migrations()))
	require.NoError(t, start(false))
}

// Over a shard map New checks every shard and names the one that lacks idem's tables.
func TestNewChecksEveryShard(t *testing.T) {
	t.Parallel()
	m := pgtest.Shards(t, pgtest.Options{NoMigrate: true})
	newest := len(migrate.Migrations())
	pgtest.ApplyMigrations(t, m.Shards[0].Pool, 1, newest)
	pgtest.ApplyMigrations(t, m.Shards[2].Pool, 1, 3)
	start := func() error {
		c, err := consumer.New(consumer.Config{Name: "x", Shards: m, Tenant: consumer.MetadataKey("tenant")})
		if err == nil {
			require.NoError(t, c.Close())
		}
		return err
	}
	err := start()
	schema := m.Shards[1].SchemaName()
	requireRefused(t, err, schema, fmt.Sprintf("shard %q: ", m.Shards[1].Name))
	requireRefused(t, err, schema, fmt.Sprintf("shard %q: ", m.Shards[2].Name))
	require.Contains(t, err.Error(), missingFrom(4))
	require.NotContains(t, err.Error(), fmt.Sprintf("shard %q", m.Shards[0].Name))
	pgtest.ApplyMigrations(t, m.Shards[1].Pool, 1, newest)
	pgtest.ApplyMigrations(t, m.Shards[2].Pool, 4, newest)
	require.NoError(t, start())
}

// A shard that does not answer at start does not stop New: the other shards are
// checked and served, and the shard's own messages are nacked until it is back.
func TestNewStartsWithoutAShardThatIsDown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	up, schema := pgtest.Setup(t)
	_, err := up.Exec(ctx, `CREATE TABLE biz (key text NOT NULL)`)
	require.NoError(t, err)
	cfg, err := pgxpool.ParseConfig("postgres://postgres@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=1")
	require.NoError(t, err)
	down, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(down.Close)
	m := &shard.Map{Shards: []shard.Shard{{Name: "up", Pool: up, Schema: schema}, {Name: "down", Pool: down}}}
	tenantOn := func(name string) string {
		for i := 0; ; i++ {
			tenant := fmt.Sprintf("t%d", i)
			if s, err := m.Pick(tenant); err == nil && s.Name == name {
				return tenant
			}
		}
	}

	c, err := consumer.New(consumer.Config{Name: "x", Shards: m, Tenant: consumer.MetadataKey("tenant")})
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	h := c.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		_, err := consumer.Tx(msg.Context()).Exec(msg.Context(), `INSERT INTO biz VALUES ($1)`, msg.UUID)
		return nil, err
	})
	send := func(tenant, key string) error {
		msg := message.NewMessage(key, []byte(`{}`))
		msg.Metadata.Set("tenant", tenant)
		_, err := h(msg)
		return err
	}
	require.NoError(t, send(tenantOn("up"), "on-up"))
	err = send(tenantOn("down"), "on-down")
	require.Equal(t, "database_unavailable", inbox.Code(err), "%v", err)
	require.Equal(t, 1, pgtest.Count(t, up, `SELECT count(*) FROM biz WHERE key = 'on-up'`))
	require.Equal(t, 0, pgtest.Count(t, up, `SELECT count(*) FROM biz WHERE key = 'on-down'`))
	require.Equal(t, 1, pgtest.Count(t, up, `SELECT count(*) FROM inbox`))
}
