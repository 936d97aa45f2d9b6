package main

import (
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
)

// The demo, in-process on an embedded NATS server, ends with a clean audit table.
func TestDemo(t *testing.T) {
	t.Parallel()
	pgtest.Require(t)
	schema := pgtest.NewSchemaName() // not idem_demo: parallel runs must not share it
	t.Cleanup(func() { pgtest.DropSchema(t, schema) })
	r := runCLI(t, "demo", "-n", "200", "--seed", "3", "--database-url", pgtest.URL(), "--schema", schema).ok(t)
	for _, want := range []string{"idem on nats", "committed once                           200", "lost !                                     0", "verdict                                   OK"} {
		require.Contains(t, squeeze(r.stdout), squeeze(want), r.stdout)
	}
	require.Contains(t, r.stderr, "embedded NATS JetStream")
}

func TestDemoKafka(t *testing.T) {
	t.Parallel()
	pgtest.Require(t)
	schema := pgtest.NewSchemaName()
	t.Cleanup(func() { pgtest.DropSchema(t, schema) })
	r := runCLI(t, "demo", "--broker", "kafka", "-n", "200", "--seed", "4", "--json", "--database-url", pgtest.URL(), "--schema", schema).ok(t)
	var out demoJSON
	r.decode(t, &out)
	require.True(t, out.OK, r.stdout)
	require.Equal(t, 200, out.Report.CommittedOnce)
	require.Zero(t, out.Report.Lost)
	require.Zero(t, out.Report.CommittedTwice)
	if os.Getenv("KAFKA_BROKERS") == "" {
		require.Contains(t, r.stderr, "in-process Kafka-protocol broker")
	}
}

// Without Postgres the demo says how to start one, and exits 2.
func TestDemoWithoutPostgres(t *testing.T) {
	t.Parallel()
	r := runCLI(t, "demo", "-n", "10", "--database-url", "postgres://postgres@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=2")
	require.Equal(t, exitUsage, r.code, r.stderr)
	require.Contains(t, r.stderr, "docker compose up -d postgres")
}

// squeeze collapses runs of spaces, so a check does not depend on column widths.
func squeeze(s string) string { return strings.Join(strings.Fields(s), " ") }
