package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/pflag"

	"github.com/idemkit/idem/cmd/idem/internal/benchkit"
	"github.com/idemkit/idem/cmd/idem/internal/scratch"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/redact"
	"github.com/idemkit/idem/migrate"
)

// shardBenchFlags are idem bench's flags of the shard comparison, which it runs
// when given a shard map (--shard, --shards, $IDEM_SHARDS).
type shardBenchFlags struct {
	tenants int
	// citus is the Citus coordinator of the Citus comparison (--citus).
	citus string
}

func (f *shardBenchFlags) register(fs *pflag.FlagSet) {
	fs.IntVar(&f.tenants, "tenants", 64, "with a shard map or --citus: tenants the messages are spread over")
	fs.StringVar(&f.citus, "citus", "", "a Citus coordinator's URL: compare plain Postgres (--database-url) with Citus, the messages spread over --tenants tenants (below)")
}

type shardBenchJSON struct {
	N           int                    `json:"n"`
	Concurrency int                    `json:"concurrency"`
	PayloadSize int                    `json:"payload_bytes"`
	DupRate     float64                `json:"dup_rate"`
	Tenants     int                    `json:"tenants"`
	Results     []benchkit.ShardResult `json:"results"`
}

// runShardBench runs the comparison over the shard map's databases: idem on the
// first shard alone, then spread by tenant over all of them. It uses only the
// map's names and URLs: it works in its own scratch schema on each, never in the
// map's schemas, and routes its own tenants by the hash (not the map's table).
func runShardBench(ctx context.Context, e *env, o benchkit.Options, f shardBenchFlags, schema string) error {
	var names, urls []string
	for _, s := range e.specs {
		names, urls = append(names, s.Name), append(urls, s.URL)
	}
	switch {
	case len(urls) < 2:
		return usagef("the shard comparison needs a map of at least 2 shards; --shard or --shards names %d", len(urls))
	case f.tenants < len(urls):
		return usagef("--tenants must be at least the number of shards (%d)", len(urls))
	case o.N < 1 || o.Concurrency < 1 || o.PayloadSize < 0 || o.DupRate < 0 || o.DupRate > 1:
		return usagef("-n and --concurrency must be at least 1, --payload not negative, --dup-rate within [0, 1]")
	}
	if err := pgschema.Validate(schema); err != nil {
		return usagef("--bench-schema: %v", err)
	}
	for _, s := range e.specs {
		if s.Schema == schema {
			return usagef("--bench-schema %s is shard %q's schema: the bench works only in a schema of its own", schema, s.Name)
		}
	}
	if len(slices.Compact(slices.Sorted(slices.Values(urls)))) != len(urls) {
		return usagef("the shard map names one database twice: the comparison needs a database a shard")
	}
	for _, u := range urls {
		claimed, err := claimShardScratch(ctx, u, schema, false)
		if err != nil {
			return err
		}
		defer claimed.Release()
	}
	fmt.Fprintf(e.notes(), "idem bench: 1 vs %d shards, %d messages a run over %d tenants, %d partitions, %d-byte payloads, %.0f%% duplicates, schema %s on each\n",
		len(urls), o.N, f.tenants, o.Concurrency, o.PayloadSize, o.DupRate*100, schema)
	var results []benchkit.ShardResult
	for _, s := range []benchkit.Setup{benchkit.PerMessage, benchkit.GroupCommit} {
		rs, err := benchkit.RunShards(ctx, benchkit.ShardOptions{Names: names, URLs: urls, Schema: schema, Setup: s,
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
// afresh, and migrates it (in Citus mode on a Citus coordinator), as claimScratch
// does on the one database.
func claimShardScratch(ctx context.Context, url, schema string, citus bool) (*scratch.Schema, error) {
	where := "shard"
	if citus {
		where = "Citus coordinator"
	}
	claimed, err := scratch.Claim(ctx, url, schema, benchScratch.tool)
	if err != nil {
		return nil, redact.Error(fmt.Errorf("%s %s: %w", where, url, scratchError(benchScratch.flag, benchScratch.tool, benchScratch.defaultSchema, err)), url)
	}
	pool, err := pgxpool.New(ctx, url)
	if err == nil {
		var m *migrate.Migrator
		if m, err = migrate.New(migrate.Config{Pool: pool, Schema: schema, Citus: citus}); err == nil {
			_, err = m.Up(ctx)
		}
		pool.Close()
	}
	if err != nil {
		claimed.Release()
		return nil, redact.Error(errors.Join(fmt.Errorf("migrate schema %s on %s %s", schema, where, url), err), url)
	}
	return claimed, nil
}
