package effects_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/migrate"
)

// requireRefused checks that NewDispatcher refused schema with code schema_missing, naming
// the schema, the command, and want.
func requireRefused(t *testing.T, err error, schema, want string) {
	t.Helper()
	require.ErrorIs(t, err, effects.ErrSchemaMissing)
	require.Equal(t, "schema_missing", inbox.Code(err))
	require.Contains(t, err.Error(), fmt.Sprintf("schema %q", schema))
	require.Contains(t, err.Error(), "`idem migrate up --schema "+schema+"`")
	require.Contains(t, err.Error(), want)
}

// noSenders is a Sender that is never called: the Dispatchers here never run.
var noSenders = map[string]effects.Sender{"email": effects.SenderFunc(func(context.Context, effects.Delivery) error { return nil })}

// missingFrom is how the check names the versions from v to the newest.
func missingFrom(v int) string {
	var vs []string
	for ; v <= len(migrate.Migrations()); v++ {
		vs = append(vs, fmt.Sprintf("%03d", v))
	}
	return strings.Join(vs, ", ") + " not applied"
}

// NewDispatcher checks the schema once, at start: an empty schema and one at an older
// migration level are refused before any message; SkipSchemaCheck skips the check.
func TestNewChecksTheSchema(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.Setup(t, pgtest.Options{NoMigrate: true})
	start := func(skip bool) error {
		_, err := effects.NewDispatcher(effects.Config{Pool: pool, Schema: schema, Senders: noSenders, SkipSchemaCheck: skip})
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

// Over a shard map NewDispatcher checks every shard and names the one that lacks idem's tables.
func TestNewChecksEveryShard(t *testing.T) {
	t.Parallel()
	m := pgtest.Shards(t, pgtest.Options{NoMigrate: true})
	newest := len(migrate.Migrations())
	pgtest.ApplyMigrations(t, m.Shards[0].Pool, 1, newest)
	pgtest.ApplyMigrations(t, m.Shards[2].Pool, 1, 3)
	start := func() error {
		_, err := effects.NewDispatcher(effects.Config{Shards: m, Senders: noSenders})
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
