package main

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/benchkit"
	"github.com/idemkit/idem/internal/pgtest"
)

func TestBench(t *testing.T) {
	t.Parallel()
	benchSchema := pgtest.NewSchemaName()
	t.Cleanup(func() { pgtest.DropSchema(t, benchSchema) })

	r := runCLI(t, "bench", "-n", "300", "--concurrency", "4", "--dup-rate", "0.2", "--json", "--drain-backlog", "0",
		"--database-url", pgtest.URL(), "--bench-schema", benchSchema).ok(t)
	var out benchJSON
	r.decode(t, &out)
	require.Len(t, out.Results, len(benchkit.AllSetups))
	for _, res := range out.Results {
		require.Positive(t, res.MsgsPerSec, res.Setup)
		require.Zero(t, res.Lost, res.Setup)
		switch res.Setup {
		case benchkit.Bare:
			require.Positive(t, res.CommittedTwice, "the bare handler has no dedupe")
		case benchkit.Drain:
			require.Equal(t, 5*300, res.Messages, "five setups enqueued one effect per message")
		default:
			require.Zero(t, res.CommittedTwice, res.Setup)
			require.Positive(t, res.RatioToBare)
		}
	}
	require.Contains(t, r.stderr, "idem bench: 300 messages per setup")

	table := runCLI(t, "bench", "-n", "50", "--concurrency", "2", "--setups", "bare,idem",
		"--database-url", pgtest.URL(), "--bench-schema", benchSchema).ok(t)
	require.Contains(t, table.stdout, "(b) idem")
	require.Contains(t, table.stdout, "× BARE")

	bad := runCLI(t, "bench", "--setups", "nope", "--database-url", pgtest.URL(), "--bench-schema", benchSchema)
	require.Equal(t, exitUsage, bad.code)
	require.Contains(t, bad.stderr, "unknown setup")
}
