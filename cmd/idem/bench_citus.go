package main

import (
	"context"
	"fmt"

	"github.com/idemkit/idem/cmd/idem/internal/benchkit"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/redact"
)

// runCitusBench compares plain Postgres (--database-url) with a Citus coordinator
// (--citus): idem per message and idem group commit, the messages spread over
// --tenants tenants, in the bench's scratch schema on each (migrated in Citus
// mode on the coordinator, with its business table distributed by tenant).
func runCitusBench(ctx context.Context, e *env, o benchkit.Options, f shardBenchFlags, schema string) error {
	switch {
	case f.tenants < 1:
		return usagef("--tenants must be at least 1")
	case o.N < 1 || o.Concurrency < 1 || o.PayloadSize < 0 || o.DupRate < 0 || o.DupRate > 1:
		return usagef("-n and --concurrency must be at least 1, --payload not negative, --dup-rate within [0, 1]")
	}
	if err := pgschema.Validate(schema); err != nil {
		return usagef("--bench-schema: %v", err)
	}
	plain := e.databaseURL
	if plain == f.citus {
		return usagef("--citus names the database of --database-url: the comparison needs plain Postgres there and a Citus coordinator in --citus")
	}
	for i, u := range []string{plain, f.citus} {
		claimed, err := claimShardScratch(ctx, u, schema, i == 1)
		if err != nil {
			return err
		}
		defer claimed.Release()
	}
	fmt.Fprintf(e.notes(), "idem bench: plain Postgres vs Citus, %d messages a run over %d tenants, %d partitions, %d-byte payloads, %.0f%% duplicates, schema %s on each\n",
		o.N, f.tenants, o.Concurrency, o.PayloadSize, o.DupRate*100, schema)
	var results []benchkit.ShardResult
	for _, s := range []benchkit.Setup{benchkit.PerMessage, benchkit.GroupCommit} {
		bar := newBenchProgress(e, string(s))
		rs, err := benchkit.RunCitus(ctx, benchkit.ShardOptions{URLs: []string{plain, f.citus}, Schema: schema, Setup: s,
			N: o.N, Concurrency: o.Concurrency, PayloadSize: o.PayloadSize, DupRate: o.DupRate, Tenants: f.tenants, Seed: o.Seed})
		bar.done()
		if err != nil {
			return redact.Error(fmt.Errorf("setup %s: %w", s, err), f.citus)
		}
		results = append(results, rs...)
	}
	if e.json {
		return e.writeJSON(shardBenchJSON{N: o.N, Concurrency: o.Concurrency, PayloadSize: o.PayloadSize, DupRate: o.DupRate,
			Tenants: f.tenants, Results: results})
	}
	tw := e.table("SETUP", "DATABASE", "MSGS/S", "× POSTGRES", "P50", "P99", "GO µs/MSG", "PG µs/MSG", "COMMITTED TWICE", "LOST")
	var base float64
	for _, r := range results {
		name := r.PerShard[0].Name
		if name == "postgres" {
			base = r.MsgsPerSec
		}
		pg := "-"
		if r.PgMicros != nil {
			pg = fmt.Sprintf("%.0f", *r.PgMicros)
		}
		fmt.Fprintf(tw, "%s\t%s\t%.0f\t%.2f\t%s\t%s\t%.0f\t%s\t%d\t%d\n", label(r.Setup), name, r.MsgsPerSec, r.MsgsPerSec/base,
			roundDur(r.P50), roundDur(r.P99), r.GoMicros, pg, r.CommittedTwice, r.Lost)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(e.stdout, "\nmsgs/s counts deliveries (duplicates included). GO µs/MSG is this process's CPU time per\n"+
		"delivery; PG µs/MSG the run's own Postgres backends' (- when Postgres is not on this host): on\n"+
		"Citus the coordinator's and those that serve them on the workers. Each handler inserts one\n"+
		"business row of its tenant and enqueues one effect.\n")
	return nil
}
