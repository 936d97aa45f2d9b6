package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/cmd/idem/internal/benchkit"
	"github.com/idemkit/idem/cmd/idem/internal/scratch"
	"github.com/idemkit/idem/internal/redact"
	"github.com/idemkit/idem/migrate"
)

// shardBenchFlags are idem bench's shard comparison: --compare-shards N runs the
// idem setups on one shard cluster, then spread by tenant over N.
type shardBenchFlags struct {
	n       int
	urls    string
	tenants int
}

func (f *shardBenchFlags) register(fs *flag.FlagSet) {
	fs.IntVar(&f.n, "compare-shards", 0, "instead of the setups: run idem per message and idem group commit on one shard cluster, then spread by tenant over this many (a shard map, the hash route), side by side, with each shard's Postgres CPU per delivery (0: off)")
	fs.StringVar(&f.urls, "shard-urls", os.Getenv("IDEM_SHARD_URLS"), "the shard clusters of --compare-shards, comma-separated Postgres URLs (default $IDEM_SHARD_URLS, which scripts/services start shards exports)")
	fs.IntVar(&f.tenants, "tenants", 64, "tenants the messages of --compare-shards are spread over")
}

type shardBenchJSON struct {
	N           int                    `json:"n"`
	Concurrency int                    `json:"concurrency"`
	PayloadSize int                    `json:"payload_bytes"`
	DupRate     float64                `json:"dup_rate"`
	Tenants     int                    `json:"tenants"`
	Results     []benchkit.ShardResult `json:"results"`
}

// runShardBench runs the comparison in a scratch schema of its own on each cluster.
func runShardBench(ctx context.Context, e *env, o benchkit.Options, f shardBenchFlags, schema string) error {
	var urls []string
	for _, u := range strings.Split(f.urls, ",") {
		if u = strings.TrimSpace(u); u != "" {
			urls = append(urls, u)
		}
	}
	switch {
	case f.n < 2:
		return usagef("--compare-shards must be at least 2")
	case len(urls) < f.n:
		return usagef("--compare-shards %d needs %d shard URLs; --shard-urls (or IDEM_SHARD_URLS) names %d (start three local clusters with: eval \"$(scripts/services start shards)\")", f.n, f.n, len(urls))
	case f.tenants < f.n:
		return usagef("--tenants must be at least --compare-shards")
	case o.N < 1 || o.Concurrency < 1 || o.PayloadSize < 0 || o.DupRate < 0 || o.DupRate > 1:
		return usagef("-n and --concurrency must be at least 1, --payload not negative, --dup-rate within [0, 1]")
	}
	urls = urls[:f.n]
	if len(slices.Compact(slices.Sorted(slices.Values(urls)))) != len(urls) {
		return usagef("--shard-urls names one database twice")
	}
	for _, u := range urls {
		claimed, err := claimShardScratch(ctx, u, schema)
		if err != nil {
			return err
		}
		defer claimed.Release()
	}
	fmt.Fprintf(e.notes(), "idem bench: 1 vs %d shards, %d messages a run over %d tenants, %d partitions, %d-byte payloads, %.0f%% duplicates, schema %s on each\n",
		f.n, o.N, f.tenants, o.Concurrency, o.PayloadSize, o.DupRate*100, schema)
	var results []benchkit.ShardResult
	for _, s := range []benchkit.Setup{benchkit.PerMessage, benchkit.GroupCommit} {
		rs, err := benchkit.RunShards(ctx, benchkit.ShardOptions{URLs: urls, Schema: schema, Setup: s,
			N: o.N, Concurrency: o.Concurrency, PayloadSize: o.PayloadSize, DupRate: o.DupRate, Tenants: f.tenants, Seed: o.Seed})
		if err != nil {
			return fmt.Errorf("setup %s: %w", s, err)
		}
		results = append(results, rs...)
	}
	if e.json {
		return e.writeJSON(shardBenchJSON{N: o.N, Concurrency: o.Concurrency, PayloadSize: o.PayloadSize, DupRate: o.DupRate,
			Tenants: f.tenants, Results: results})
	}
	tw := e.table("SETUP", "SHARDS", "MSGS/S", "× 1 SHARD", "P50", "P99", "GO µs/MSG", "PG µs/MSG", "PER SHARD: DELIVERIES, PG µs/MSG, PG CPU s", "COMMITTED TWICE", "LOST")
	var one float64
	for _, r := range results {
		if r.Shards == 1 {
			one = r.MsgsPerSec
		}
		var per []string
		for _, s := range r.PerShard {
			if s.PgMicros == nil {
				per = append(per, fmt.Sprintf("%s %d, -", s.Name, s.Deliveries))
				continue
			}
			per = append(per, fmt.Sprintf("%s %d, %.0f, %.1f", s.Name, s.Deliveries, *s.PgMicros, *s.PgSeconds))
		}
		pg := "-"
		if r.PgMicros != nil {
			pg = fmt.Sprintf("%.0f", *r.PgMicros)
		}
		fmt.Fprintf(tw, "%s\t%d\t%.0f\t%.2f\t%s\t%s\t%.0f\t%s\t%s\t%d\t%d\n", label(r.Setup), r.Shards, r.MsgsPerSec, r.MsgsPerSec/one,
			roundDur(r.P50), roundDur(r.P99), r.GoMicros, pg, strings.Join(per, "; "), r.CommittedTwice, r.Lost)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(e.stdout, "\nmsgs/s counts deliveries (duplicates included). GO µs/MSG is this process's CPU time per\n"+
		"delivery; PG µs/MSG the run's own Postgres backends' on every shard (- when Postgres is not on\n"+
		"this host), and per shard its backends' per delivery it handled and in all. The shard clusters\n"+
		"share this machine's cores: more shards spread the locks and the WAL, not the CPU.\n")
	return nil
}

// claimShardScratch claims the bench's scratch schema on one shard cluster, made
// afresh, and migrates it, as claimScratch does on the one database.
func claimShardScratch(ctx context.Context, url, schema string) (*scratch.Schema, error) {
	claimed, err := scratch.Claim(ctx, url, schema, benchScratch.tool)
	if err != nil {
		return nil, redact.Error(fmt.Errorf("shard %s: %w", url, scratchError(benchScratch.flag, benchScratch.tool, benchScratch.defaultSchema, err)), url)
	}
	pool, err := pgxpool.New(ctx, url)
	if err == nil {
		var m *migrate.Migrator
		if m, err = migrate.New(migrate.Config{Pool: pool, Schema: schema}); err == nil {
			_, err = m.Up(ctx)
		}
		pool.Close()
	}
	if err != nil {
		claimed.Release()
		return nil, redact.Error(errors.Join(fmt.Errorf("migrate schema %s on shard %s", schema, url), err), url)
	}
	return claimed, nil
}
