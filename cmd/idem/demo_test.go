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
	// stderr is no terminal here (idem demo 2>log): plain progress lines, the
	// last one the final state, and no bar frames.
	require.NotContains(t, r.stderr, "\r")
	require.Regexp(t, `(?m)^200/200 committed, \d+ emails, \d+ restarts, \d+ cuts, `, r.stderr)
	for _, l := range strings.Split(r.stderr, "\n") {
		require.LessOrEqual(t, len(l), 200, "%q", l)
	}
}

// The demo through Kafka: always on the in-process kfake broker, and also on the
// real broker of KAFKA_BROKERS when that is set. Each run's output names its
// broker.
func TestDemoKafka(t *testing.T) {
	t.Parallel()
	pgtest.Require(t)
	brokers := map[string]string{"kfake": ""}
	if b := os.Getenv("KAFKA_BROKERS"); b != "" {
		brokers["external"] = b
	}
	for name, addr := range brokers {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			if addr == "" {
				t.Logf("broker: in-process kfake")
			} else {
				t.Logf("broker: Kafka at %s (KAFKA_BROKERS)", addr)
			}
			schema := pgtest.NewSchemaName()
			t.Cleanup(func() { pgtest.DropSchema(t, schema) })
			r := runCLI(t, "demo", "--broker", "kafka", "--kafka-brokers", addr, "-n", "200", "--seed", "4", "--json",
				"--database-url", pgtest.URL(), "--schema", schema).ok(t)
			var out demoJSON
			r.decode(t, &out)
			require.True(t, out.OK, r.stdout)
			require.Equal(t, 200, out.Report.CommittedOnce)
			require.Zero(t, out.Report.Lost)
			require.Zero(t, out.Report.CommittedTwice)
			require.Empty(t, r.stderr, "with --json, stderr holds JSON only: no progress")
			if addr == "" {
				require.True(t, strings.HasPrefix(out.BrokerAddress, "127.0.0.1:"), out.BrokerAddress)
				require.NotEqual(t, os.Getenv("KAFKA_BROKERS"), out.BrokerAddress)
				require.Empty(t, out.Topic)
			} else {
				require.Equal(t, addr, out.BrokerAddress)
				require.True(t, strings.HasPrefix(out.Topic, "idem-demo-"+schema+"-"), out.Topic)
			}
		})
	}
}

// Without Postgres the demo says how to start one, and exits 3 like every other
// command; the password of the DSN is never printed.
func TestDemoWithoutPostgres(t *testing.T) {
	t.Parallel()
	r := runCLI(t, "demo", "-n", "10", "--database-url", "postgres://postgres:demo-s3cret-pw@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=2")
	require.Equal(t, exitNoPostgres, r.code, r.stderr)
	require.Contains(t, r.stderr, "docker compose up -d postgres")
	require.NotContains(t, r.stdout+r.stderr, "demo-s3cret-pw")
}

// squeeze collapses runs of spaces, so a check does not depend on column widths.
func squeeze(s string) string { return strings.Join(strings.Fields(s), " ") }
