package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/idemkit/idem/cmd/idem/internal/benchkit"
	"github.com/idemkit/idem/internal/pgtest"
)

// runBenchCLI is runCLI with a deadline for a benchmark: every setup in turn,
// under -race, on a machine shared with other tests, takes longer than runCLI's
// 30 seconds allow.
func runBenchCLI(t *testing.T, args ...string) result {
	t.Helper()
	var out, errOut bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	code := run(ctx, args, &out, &errOut)
	return result{code: code, stdout: out.String(), stderr: errOut.String()}
}

func TestBench(t *testing.T) {
	t.Parallel()
	benchSchema := pgtest.NewSchemaName()
	t.Cleanup(func() { pgtest.DropSchema(t, benchSchema) })

	// No brokers given: every setup but kafka-external, whatever KAFKA_BROKERS says.
	r := runBenchCLI(t, "bench", "-n", "300", "--concurrency", "4", "--dup-rate", "0.2", "--json", "--drain-backlog", "0",
		"--kafka-partitions", "4", "--kafka-in-flight", "16", "--kafka-brokers", "",
		"--database-url", pgtest.URL(), "--bench-schema", benchSchema).ok(t)
	var out benchJSON
	r.decode(t, &out)
	require.Len(t, out.Results, len(benchkit.AllSetups)-1)
	for _, res := range out.Results {
		require.NotEqual(t, benchkit.KafkaExternal, res.Setup)
		require.Positive(t, res.MsgsPerSec, res.Setup)
		require.Zero(t, res.Lost, res.Setup)
		switch res.Setup {
		case benchkit.Bare:
			require.Positive(t, res.CommittedTwice, "the bare handler has no dedupe")
		case benchkit.Drain:
			require.Equal(t, 6*300, res.Messages, "six setups enqueued one effect per message")
		default:
			require.Zero(t, res.CommittedTwice, res.Setup)
			require.Positive(t, res.RatioToBare)
		}
		// The cost per delivery: this process's CPU and allocations, and the CPU
		// of the run's own Postgres backends (on this host in the tests).
		require.Positive(t, res.CPU.GoMicros, res.Setup)
		require.Positive(t, res.CPU.Allocs, res.Setup)
		require.Positive(t, res.CPU.AllocBytes, res.Setup)
		require.NotNil(t, res.CPU.PgMicros, res.Setup)
		require.Positive(t, *res.CPU.PgMicros, res.Setup)
		if res.Setup == benchkit.Kafka {
			require.Contains(t, res.Broker, "kfake")
			require.True(t, strings.HasPrefix(res.Topic, benchkit.TopicPrefix), res.Topic)
		}
	}
	require.Empty(t, r.stderr, "with --json, stderr holds JSON only: no progress")
	require.Equal(t, 300, out.N)
	require.Equal(t, 4, out.KafkaPartitions)

	profiles := t.TempDir()
	table := runCLI(t, "bench", "-n", "50", "--concurrency", "2", "--setups", "bare,idem", "--profile-dir", profiles,
		"--database-url", pgtest.URL(), "--bench-schema", benchSchema).ok(t)
	require.Contains(t, table.stdout, "(b) idem")
	require.Contains(t, table.stdout, "× BARE")
	require.Contains(t, table.stdout, "GO µs/MSG (GC)")
	require.Contains(t, table.stdout, "PG µs/MSG")
	require.Contains(t, table.stdout, "ALLOCS/MSG")
	for _, s := range []string{"bare", "idem"} {
		for _, suffix := range []string{".cpu.pprof", ".allocs-start.pprof", ".allocs.pprof"} {
			fi, err := os.Stat(filepath.Join(profiles, s+suffix))
			require.NoError(t, err)
			require.Positive(t, fi.Size(), s+suffix)
		}
	}
	require.Contains(t, table.stderr, "idem bench: 50 messages per setup", "without --json, the notes and progress go to stderr")
	// stderr is no terminal here (idem bench 2>log): plain progress lines, no
	// bar frames.
	require.NotContains(t, table.stderr, "\r")
	require.Regexp(t, `(?m)^bare\s+done in `, table.stderr)

	bad := runCLI(t, "bench", "--setups", "nope", "--database-url", pgtest.URL(), "--bench-schema", benchSchema)
	require.Equal(t, exitUsage, bad.code)
	require.Contains(t, bad.stderr, "unknown setup")

	noBrokers := runCLI(t, "bench", "--setups", "kafka-external", "--kafka-brokers", "",
		"--database-url", pgtest.URL(), "--bench-schema", benchSchema)
	require.Equal(t, exitUsage, noBrokers.code)
	require.Contains(t, noBrokers.stderr, "--kafka-brokers")
}

// TestBenchKafka runs the Kafka setups from the CLI, kafka-external on a kfake
// cluster of the test's own and, when KAFKA_BROKERS is set, on that broker: the
// output names the broker, nothing is lost or committed twice, and the topics the
// run made are gone while one made before it is untouched.
func TestBenchKafka(t *testing.T) {
	t.Parallel()
	c, err := kfake.NewCluster(kfake.NumBrokers(1),
		kfake.BrokerConfigs(map[string]string{"group.min.session.timeout.ms": "100"}))
	require.NoError(t, err)
	t.Cleanup(c.Close)
	targets := [][]string{c.ListenAddrs()}
	if v := os.Getenv("KAFKA_BROKERS"); v != "" {
		targets = append(targets, strings.Split(v, ","))
	} else {
		t.Log("KAFKA_BROKERS is not set: kafka-external runs on kfake only")
	}
	for _, brokers := range targets {
		t.Run(strings.Join(brokers, ","), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			client := &kafkago.Client{Addr: kafkago.TCP(brokers...), Timeout: 30 * time.Second}
			keep := benchkit.TopicPrefix + "keep-" + pgtest.NewSchemaName()
			cr, err := client.CreateTopics(ctx, &kafkago.CreateTopicsRequest{Topics: []kafkago.TopicConfig{{
				Topic: keep, NumPartitions: 1, ReplicationFactor: -1}}})
			require.NoError(t, err)
			require.NoError(t, cr.Errors[keep])
			t.Cleanup(func() {
				_, _ = client.DeleteTopics(context.Background(), &kafkago.DeleteTopicsRequest{Topics: []string{keep}})
			})

			benchSchema := pgtest.NewSchemaName()
			t.Cleanup(func() { pgtest.DropSchema(t, benchSchema) })
			r := runBenchCLI(t, "bench", "-n", "200", "--dup-rate", "0.1", "--setups", "kafka,kafka-external", "--json",
				"--kafka-partitions", "4", "--kafka-in-flight", "16", "--kafka-brokers", strings.Join(brokers, ","),
				"--database-url", pgtest.URL(), "--bench-schema", benchSchema).ok(t)
			var out benchJSON
			r.decode(t, &out)
			require.Len(t, out.Results, 2)
			require.Contains(t, out.Results[0].Broker, "kfake (in process)")
			require.Equal(t, "Kafka at "+strings.Join(brokers, ","), out.Results[1].Broker)
			require.Empty(t, r.stderr, "with --json, stderr holds JSON only")
			for _, res := range out.Results {
				require.Zero(t, res.Lost, res.Setup)
				require.Zero(t, res.CommittedTwice, res.Setup)
				require.Greater(t, res.Deliveries, 200, res.Setup)
			}
			names := func() []string {
				md, err := client.Metadata(ctx, &kafkago.MetadataRequest{})
				require.NoError(t, err)
				var ns []string
				for _, tp := range md.Topics {
					ns = append(ns, tp.Name)
				}
				return ns
			}
			pgtest.WaitFor(t, 30*time.Second, fmt.Sprintf("topic %s is still there", out.Results[1].Topic), func() bool { return !slices.Contains(names(), out.Results[1].Topic) })
			require.Contains(t, names(), keep)
		})
	}
}
