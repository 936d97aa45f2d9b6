package main

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/pflag"

	"github.com/idemkit/idem/cmd/idem/internal/benchkit"
	"github.com/idemkit/idem/internal/pgschema"
)

// benchSchema is the benchmark's own schema by default.
const benchSchema = "idem_bench"

var benchCmd = &command{
	name: "bench",
	args: "[flags]",
	summary: "Drive one workload under several setups side by side: (a) a bare handler with its own " +
		"transaction, (b) idem per message, (c) idem set-based group commit with the same per-message handler, " +
		"(d) Watermill's Deduplicator, (e) idem with a batch handler (one set-based insert per batch, on " +
		"--batch-partitions partitions), (g) kafka: the batch handler over idem's Kafka adapter on an in-process " +
		"Kafka-protocol broker (kfake), measured from produce to the offset commit, (h) kafka-external: the same on " +
		"the real brokers of --kafka-brokers (default $KAFKA_BROKERS; run only when given), and last (f) the effect " +
		"Dispatcher draining what the others enqueued, topped up to --drain-backlog, in a table never analyzed. Each " +
		"handler does one business insert and emits one effect per message. It works in a schema of its own, --bench-schema, which it drops and " +
		"makes again; it refuses a schema it did not make. On a Kafka broker it creates one topic and one consumer " +
		"group per Kafka setup, named idem-bench-<random run id>-<setup>, and deletes those two at the end; it " +
		"touches no other topic or group. Given a shard map (--shard, --shards), it compares the map's first shard " +
		"alone with all of its shards instead; given --citus, plain Postgres with Citus (below).",
	example: `idem bench
idem bench -n 1000000 --concurrency 32 --dup-rate 0.1 --payload 256
idem bench --setups bare,idem,idem-group --json
idem bench --setups kafka,kafka-external --kafka-brokers localhost:9092
idem bench --shards shards.json -n 10000
idem bench --shard s1=postgres://db1/app --shard s2=postgres://db2/app --shard s3=postgres://db3/app

With a shard map (--shard, --shards or $IDEM_SHARDS) it compares one shard with
all of them instead: idem per message and idem group commit on the map's first
shard alone, then spread by tenant (--tenants, the hash route) over every shard,
side by side, with each shard's deliveries and Postgres CPU. It uses only the
map's names and URLs: on each database it works in --bench-schema, never in the
map's schema, and its tenants follow the hash, not the map's table.

With --citus URL it compares plain Postgres (--database-url) with the Citus
coordinator at URL: idem per message and idem group commit, the messages spread
over --tenants tenants, each handler inserting a row of its tenant. On the
coordinator it migrates --bench-schema in Citus mode and distributes its business
table by tenant; its Postgres CPU counts the workers' backends that serve the run.
  idem bench --citus postgres://coordinator:5432/app -n 20000`,
	files: []string{"profile-dir"},
	setup: func(fs *pflag.FlagSet) runFunc {
		var o benchkit.Options
		var setups, schema, kafkaBrokers string
		fs.IntVarP(&o.N, "n", "n", 20000, "unique messages per setup")
		fs.IntVar(&o.Concurrency, "concurrency", 16, "partitions handled at once (one message in flight each)")
		fs.IntVar(&o.PayloadSize, "payload", 128, "payload size in bytes")
		fs.Float64Var(&o.DupRate, "dup-rate", 0.1, "fraction of messages delivered twice")
		fs.IntVar(&o.MaxBatch, "max-batch", 0, "group-commit batch size (consumer default if 0)")
		durationVar(fs, &o.MaxWait, "max-wait", 0, "group-commit wait for a fuller batch (consumer default if 0)")
		fs.IntVar(&o.Workers, "workers", 0, "group-commit batches at once (consumer default if 0)")
		fs.IntVar(&o.DrainBacklog, "drain-backlog", 100000, "fewest effects the dispatcher setup drains: it adds its own to what the other setups enqueued")
		var sh shardBenchFlags
		sh.register(fs)
		fs.IntVar(&o.BatchPartitions, "batch-partitions", benchkit.DefaultBatchPartitions, "partitions of the batch-handler setup (idem-batch)")
		fs.IntVar(&o.BatchMaxBatch, "batch-max-batch", benchkit.DefaultBatchMaxBatch, "batch size of the batch-handler setup")
		fs.IntVar(&o.KafkaPartitions, "kafka-partitions", benchkit.DefaultKafkaPartitions, "partitions of the topic each Kafka setup creates")
		fs.IntVar(&o.KafkaInFlight, "kafka-in-flight", benchkit.DefaultKafkaInFlight, "the Kafka subscriber's MaxInFlightPerPartition in the Kafka setups")
		fs.IntVar(&o.KafkaMaxBatch, "kafka-max-batch", benchkit.DefaultKafkaMaxBatch, "batch size of the batch handler in the Kafka setups")
		fs.StringVar(&kafkaBrokers, "kafka-brokers", os.Getenv("KAFKA_BROKERS"),
			"Kafka brokers of the kafka-external setup, comma-separated (default $KAFKA_BROKERS; empty: that setup is not run)")
		fs.StringVar(&setups, "setups", "", "setups to run, comma-separated (default all: "+joinSetups(benchkit.AllSetups)+
			"; kafka-external only with --kafka-brokers)")
		fs.StringVar(&o.ProfileDir, "profile-dir", "", "write a CPU profile and allocation profiles of each setup's timed part to this folder: <setup>.cpu.pprof, <setup>.allocs-start.pprof and <setup>.allocs.pprof (their difference: go tool pprof -sample_index=alloc_space -diff_base <setup>.allocs-start.pprof <setup>.allocs.pprof)")
		fs.StringVar(&schema, "bench-schema", benchSchema, "schema the benchmark creates, marks as its own, and drops on its next run (it refuses any schema it did not create)")
		return func(ctx context.Context, e *env, args []string) error {
			if b := strings.TrimSpace(kafkaBrokers); b != "" {
				for _, h := range strings.Split(b, ",") {
					o.KafkaBrokers = append(o.KafkaBrokers, strings.TrimSpace(h))
				}
			}
			if err := noArgs(args); err != nil {
				return err
			}
			if sh.citus != "" {
				switch {
				case e.shardsGiven():
					return usagef("--citus compares plain Postgres (--database-url) with Citus: leave out the shard map (--shard, --shards, $IDEM_SHARDS)")
				case setups != "":
					return usagef("with --citus the bench runs its own setups (idem, idem-group on plain Postgres and on Citus): leave out --setups")
				}
				return runCitusBench(ctx, e, o, sh, schema)
			}
			if e.shardsGiven() {
				if setups != "" {
					return usagef("with a shard map the bench runs its own setups (idem, idem-group on 1 shard and on all): leave out --setups")
				}
				return runShardBench(ctx, e, o, sh, schema)
			}
			return runBench(ctx, e, o, setups, schema)
		}
	},
}

func joinSetups(ss []benchkit.Setup) string {
	out := make([]string, len(ss))
	for i, s := range ss {
		out[i] = string(s)
	}
	return strings.Join(out, ",")
}

type benchJSON struct {
	N           int     `json:"n"`
	Concurrency int     `json:"concurrency"`
	PayloadSize int     `json:"payload_bytes"`
	DupRate     float64 `json:"dup_rate"`
	// The Kafka setups' topic partitions and MaxInFlightPerPartition.
	KafkaPartitions int               `json:"kafka_partitions"`
	KafkaInFlight   int               `json:"kafka_in_flight"`
	MaxRSSBytes     int64             `json:"max_rss_bytes"`
	Results         []benchResultJSON `json:"results"`
}

type benchResultJSON struct {
	benchkit.Result
	RatioToBare float64 `json:"ratio_to_bare,omitempty"`
}

func runBench(ctx context.Context, e *env, o benchkit.Options, setupList, schema string) error {
	if o.N < 1 || o.Concurrency < 1 || o.PayloadSize < 0 || o.DupRate < 0 || o.DupRate > 1 {
		return usagef("-n and --concurrency must be at least 1, --payload not negative, --dup-rate within [0, 1]")
	}
	if o.KafkaPartitions < 1 || o.KafkaInFlight < 1 || o.KafkaMaxBatch < 1 {
		return usagef("--kafka-partitions, --kafka-in-flight and --kafka-max-batch must be at least 1")
	}
	if slices.Contains(o.KafkaBrokers, "") {
		return usagef("--kafka-brokers %q names an empty broker", strings.Join(o.KafkaBrokers, ","))
	}
	if err := pgschema.Validate(schema); err != nil {
		return usagef("--bench-schema: %v", err)
	}
	var setups []benchkit.Setup
	if setupList == "" {
		for _, s := range benchkit.AllSetups {
			if s != benchkit.KafkaExternal || len(o.KafkaBrokers) > 0 {
				setups = append(setups, s)
			}
		}
	} else {
		for _, s := range strings.Split(setupList, ",") {
			s = strings.TrimSpace(s)
			if !slices.Contains(benchkit.AllSetups, benchkit.Setup(s)) {
				return usagef("unknown setup %q (known: %s)", s, joinSetups(benchkit.AllSetups))
			}
			if benchkit.Setup(s) == benchkit.KafkaExternal && len(o.KafkaBrokers) == 0 {
				return usagef("setup kafka-external needs Kafka brokers: --kafka-brokers host:port,... or KAFKA_BROKERS")
			}
			setups = append(setups, benchkit.Setup(s))
		}
	}
	pool, err := e.connect(ctx)
	if err != nil {
		return err
	}
	// The benchmark empties its schema between setups: it works only in one that
	// it (or idem demo) made and marked, made afresh, and never in one that
	// another run is using.
	claimed, err := claimScratch(ctx, e, pool, schema, benchScratch)
	if err != nil {
		return err
	}
	defer claimed.Release()
	o.DatabaseURL, o.Schema = e.databaseURL, schema
	if err := benchkit.Prepare(ctx, o); err != nil {
		return err
	}
	fmt.Fprintf(e.notes(), "idem bench: %d messages per setup, %d partitions, %d-byte payloads, %.0f%% duplicates, schema %s\n",
		o.N, o.Concurrency, o.PayloadSize, o.DupRate*100, schema)

	var results []benchkit.Result
	for _, s := range setups {
		bar := newBenchProgress(e, string(s))
		o.Progress = bar.update
		res, err := benchkit.Run(ctx, s, o)
		bar.done()
		if err != nil {
			return fmt.Errorf("setup %s: %w", s, err)
		}
		if res.Broker != "" {
			fmt.Fprintf(e.notes(), "  %-12s ran on %s, topic and group %s (deleted)\n", s, res.Broker, res.Topic)
		}
		results = append(results, res)
	}
	var bare float64
	for _, r := range results {
		if r.Setup == benchkit.Bare {
			bare = r.MsgsPerSec
		}
	}
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	maxRSS := ru.Maxrss * 1024 // kilobytes on Linux

	if e.json {
		out := benchJSON{N: o.N, Concurrency: o.Concurrency, PayloadSize: o.PayloadSize, DupRate: o.DupRate, MaxRSSBytes: maxRSS,
			KafkaPartitions: o.KafkaPartitions, KafkaInFlight: o.KafkaInFlight}
		for _, r := range results {
			j := benchResultJSON{Result: r}
			if bare > 0 && r.Setup != benchkit.Bare && r.Setup != benchkit.Drain {
				j.RatioToBare = r.MsgsPerSec / bare
			}
			out.Results = append(out.Results, j)
		}
		return e.writeJSON(out)
	}
	tw := e.table("SETUP", "MSGS/S", "× BARE", "P50", "P99", "COMMITS/MSG", "ROUND TRIPS/MSG", "COMMITTED TWICE", "LOST", "PEAK HEAP",
		"GO µs/MSG (GC)", "PG µs/MSG", "ALLOCS/MSG", "BYTES/MSG")
	for _, r := range results {
		ratio := "-"
		if bare > 0 && r.Setup != benchkit.Drain {
			ratio = fmt.Sprintf("%.2f", r.MsgsPerSec/bare)
		}
		pg := "-"
		if r.CPU.PgMicros != nil {
			pg = fmt.Sprintf("%.1f", *r.CPU.PgMicros)
		}
		fmt.Fprintf(tw, "%s\t%.0f\t%s\t%s\t%s\t%.2f\t%.2f\t%d\t%d\t%s\t%.1f (%.1f)\t%s\t%.0f\t%.0f\n", label(r.Setup), r.MsgsPerSec, ratio,
			roundDur(r.P50), roundDur(r.P99), r.CommitsPerMsg, r.TripsPerMsg, r.CommittedTwice, r.Lost, mib(r.PeakHeapBytes),
			r.CPU.GoMicros, r.CPU.GCMicros, pg, r.CPU.Allocs, r.CPU.AllocBytes)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(e.stdout, "\nmsgs/s counts deliveries (duplicates included); the dispatcher row counts effects and its\n"+
		"latency is from the effect's commit to its send. Committed twice is expected only for the bare\n"+
		"handler, which has no dedupe. The last four columns are per delivery (per effect for the\n"+
		"dispatcher), over the timed part of each run: CPU time of this process (of it, the garbage\n"+
		"collector's) and of the run's own Postgres backends (- when Postgres is not on this host),\n"+
		"and this process's heap allocations. Process max RSS: %s.\n", mib(uint64(maxRSS)))
	kafkaRows := false
	for _, r := range results {
		if r.Broker != "" {
			kafkaRows = true
			fmt.Fprintf(e.stdout, "%s: %s, topic %s (deleted), %d partitions × %d in flight.\n",
				label(r.Setup), r.Broker, r.Topic, o.KafkaPartitions, o.KafkaInFlight)
		}
	}
	if kafkaRows {
		fmt.Fprintf(e.stdout, "Kafka rows: the clock runs from the first produce to the group's last offset commit; latency is\n"+
			"from a record's Publish to its ack (its batch committed).\n")
	}
	return nil
}

func label(s benchkit.Setup) string {
	return map[benchkit.Setup]string{
		benchkit.Bare: "(a) bare", benchkit.PerMessage: "(b) idem", benchkit.GroupCommit: "(c) idem group commit",
		benchkit.Deduplicator: "(d) deduplicator", benchkit.Batch: "(e) idem batch handler", benchkit.Drain: "(f) dispatcher",
		benchkit.Kafka: "(g) kafka (kfake) batch", benchkit.KafkaExternal: "(h) kafka (external) batch",
	}[s]
}

func roundDur(d time.Duration) string {
	switch {
	case d >= time.Second:
		return d.Round(10 * time.Millisecond).String()
	case d >= time.Millisecond:
		return d.Round(10 * time.Microsecond).String()
	}
	return d.Round(time.Microsecond).String()
}

func mib(b uint64) string { return fmt.Sprintf("%.0f MiB", float64(b)/(1<<20)) }

// benchProgress shows a setup's deliveries so far, as bench runs it.
type benchProgress struct {
	p     *progress
	name  string
	start time.Time
}

func newBenchProgress(e *env, name string) *benchProgress {
	return &benchProgress{p: e.progress(), name: name, start: time.Now()}
}

func (b *benchProgress) update(done, total int) {
	if total == 0 {
		return
	}
	frac := min(float64(done)/float64(total), 1)
	b.p.show(frac, fmt.Sprintf("%-12s %3.0f%% %d/%d %s", b.name, frac*100, done, total, time.Since(b.start).Round(time.Second)))
}

func (b *benchProgress) done() {
	b.p.end(fmt.Sprintf("%-12s done in %s", b.name, time.Since(b.start).Round(100*time.Millisecond)))
}
