package benchkit

import (
	"cmp"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/cpustat"
	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/redact"
	"github.com/idemkit/idem/shard"
)

// ShardOptions is the shard comparison: the same workload on the first of URLs
// alone, then spread by tenant over all of them (a shard map, the hash route).
type ShardOptions struct {
	// URLs are the shard clusters' databases, Names their shards' names (s1, s2,
	// ... when nil); Schema, on each, is the caller's scratch schema, migrated
	// (the comparison empties its tables).
	Names  []string
	URLs   []string
	Schema string
	// Setup is PerMessage or GroupCommit.
	Setup Setup
	// N unique messages a run, DupRate of them delivered twice, from Concurrency
	// partitions with one message in flight each.
	N, Concurrency, PayloadSize int
	DupRate                     float64
	// Tenants the messages are spread over (round robin); the route spreads the
	// tenants over the shards.
	Tenants int
	Seed    uint64
}

// ShardResult is one run of the comparison.
type ShardResult struct {
	Setup      Setup         `json:"setup"`
	Shards     int           `json:"shards"`
	Deliveries int           `json:"deliveries"`
	Elapsed    time.Duration `json:"elapsed_ns"`
	MsgsPerSec float64       `json:"msgs_per_sec"`
	P50        time.Duration `json:"p50_ns"`
	P99        time.Duration `json:"p99_ns"`
	// GoMicros is this process's CPU time per delivery, in µs; PgMicros every
	// shard's backends' (nil when they cannot be read: Postgres on another host).
	GoMicros float64  `json:"go_cpu_us"`
	PgMicros *float64 `json:"pg_cpu_us,omitempty"`
	// PerShard is each shard's share: its deliveries and its backends' CPU time
	// per delivery it handled.
	PerShard []ShardShare `json:"per_shard"`
	// CommittedTwice and Lost are counted from the business rows of every shard.
	CommittedTwice int `json:"committed_twice"`
	Lost           int `json:"lost"`
}

// ShardShare is one shard's part of a run.
type ShardShare struct {
	Name       string   `json:"name"`
	Deliveries int      `json:"deliveries"`
	PgMicros   *float64 `json:"pg_cpu_us,omitempty"`
	// PgSeconds is its backends' CPU time over the run.
	PgSeconds *float64 `json:"pg_cpu_seconds,omitempty"`
}

// RunShards runs the workload on one shard, then on every shard of o.URLs, and
// returns both runs. Errors never show a database password.
func RunShards(ctx context.Context, o ShardOptions) ([]ShardResult, error) {
	if len(o.URLs) < 2 {
		return nil, errors.New("benchkit: the shard comparison needs at least two shard URLs")
	}
	return runEach(ctx, o, "shard", []spread{
		{label: "1 shard(s)", urls: o.URLs[:1], names: o.Names},
		{label: fmt.Sprintf("%d shard(s)", len(o.URLs)), urls: o.URLs, names: o.Names},
	})
}

// RunCitus runs the workload on plain Postgres, o.URLs[0], then on the Citus
// coordinator o.URLs[1], whose scratch schema is migrated in Citus mode, and
// returns both runs. On each the messages are spread over o.Tenants tenants, and
// on Citus the business table is distributed by tenant, colocated with idem's
// inbox. Errors never show a database password.
func RunCitus(ctx context.Context, o ShardOptions) ([]ShardResult, error) {
	if len(o.URLs) != 2 {
		return nil, errors.New("benchkit: the Citus comparison needs two URLs: plain Postgres, then the Citus coordinator")
	}
	return runEach(ctx, o, "Citus", []spread{
		{label: "postgres", urls: o.URLs[:1], names: []string{"postgres"}},
		{label: "citus", urls: o.URLs[1:], names: []string{"citus"}, citus: true},
	})
}

// spread is one run of a comparison: the workload spread by tenant over urls,
// named names (s1, s2, ... when nil), a Citus coordinator when citus.
type spread struct {
	label       string
	urls, names []string
	citus       bool
}

// runEach runs o's workload as each of runs, in turn, for the comparison named
// what.
func runEach(ctx context.Context, o ShardOptions, what string, runs []spread) ([]ShardResult, error) {
	if o.Setup != PerMessage && o.Setup != GroupCommit {
		return nil, fmt.Errorf("benchkit: the %s comparison runs %s or %s, not %s", what, PerMessage, GroupCommit, o.Setup)
	}
	o.Concurrency = cmp.Or(o.Concurrency, 16)
	o.Tenants = cmp.Or(o.Tenants, 64)
	var out []ShardResult
	for _, run := range runs {
		o.Names = run.names
		r, err := runShards(ctx, o, run.urls, run.citus)
		if err != nil {
			for _, u := range o.URLs {
				err = redact.Error(err, u)
			}
			return out, fmt.Errorf("%s: %w", run.label, err)
		}
		out = append(out, r)
	}
	return out, nil
}

// runShards runs the workload spread by tenant over urls, a shard map of them;
// citus says urls is one Citus coordinator.
func runShards(ctx context.Context, o ShardOptions, urls []string, citus bool) (ShardResult, error) {
	m := &shard.Map{}
	apps := make([]string, len(urls))
	defer func() {
		for _, s := range m.Shards {
			s.Pool.Close()
		}
	}()
	for i, u := range urls {
		cfg, err := pgxpool.ParseConfig(u)
		if err != nil {
			return ShardResult{}, fmt.Errorf("shard URL: %w", err)
		}
		// Each pool as large as the one-database run's: a shard gets a share of
		// the partitions, but any of them at a time.
		cfg.MaxConns = int32(o.Concurrency) + 4
		apps[i] = newAppName()
		cfg.ConnConfig.RuntimeParams["application_name"] = apps[i]
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			return ShardResult{}, err
		}
		name := fmt.Sprintf("s%d", i+1)
		if i < len(o.Names) {
			name = o.Names[i]
		}
		m.Shards = append(m.Shards, shard.Shard{Name: name, Pool: pool, Schema: o.Schema})
		if err := resetTenants(ctx, pool, o.Schema, citus); err != nil {
			return ShardResult{}, err
		}
	}
	cfg := consumer.Config{Name: "bench", Shards: m, Tenant: consumer.MetadataKey("tenant")}
	if o.Setup == GroupCommit {
		cfg.Mode = consumer.GroupCommit
	}
	c, err := consumer.New(cfg)
	if err != nil {
		return ShardResult{}, err
	}
	defer func() { _ = c.Close() }()
	biz := pgx.Identifier{o.Schema, tenantBiz}.Sanitize()
	h := c.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx := consumer.Tx(ctx)
		if _, err := tx.Exec(ctx, `INSERT INTO `+biz+` (tenant, key, payload) VALUES ($1, $2, $3)`,
			msg.Metadata.Get("tenant"), msg.UUID, msg.Payload); err != nil {
			return nil, err
		}
		sc, _ := effectsdb.ScopeFrom(ctx)
		_, err := effectsdb.Enqueue(ctx, tx, sc, effectsdb.Effect{Kind: "bench", Key: "fx:" + msg.UUID, Payload: msg.Payload})
		return nil, err
	})

	// Each partition is one goroutine with one message in flight, as in Run.
	type delivery struct {
		id, tenant string
	}
	parts := make([]chan delivery, o.Concurrency)
	for p := range parts {
		parts[p] = make(chan delivery, 64)
	}
	payload := make([]byte, o.PayloadSize)
	_, _ = rand.Read(payload)
	hist := newHistogram()
	var failed atomic.Pointer[error]

	for _, s := range m.Shards {
		if err := warm(ctx, s.Pool); err != nil {
			return ShardResult{}, err
		}
	}
	take := cpustat.Take
	if citus {
		take = cpustat.TakeCitus
	}
	before := make([]cpustat.Sample, len(m.Shards))
	for i, s := range m.Shards {
		before[i] = take(ctx, s.Pool, apps[i])
	}
	start := time.Now()
	var workers sync.WaitGroup
	for p := range parts {
		workers.Go(func() {
			for d := range parts[p] {
				msg := message.NewMessage(d.id, payload)
				msg.Metadata.Set("tenant", d.tenant)
				for {
					t := time.Now()
					_, err := h(msg)
					if err == nil {
						hist.observe(time.Since(t))
						break
					}
					if ctx.Err() != nil {
						failed.CompareAndSwap(nil, &err)
						break
					}
					// A transient error (a busy key, a cut connection) is redelivered,
					// as a broker would.
					msg = msg.Copy()
				}
			}
		})
	}
	rng := mrand.New(mrand.NewPCG(o.Seed, 42))
	perShard := make([]int, len(m.Shards))
	total := 0
	for i := range o.N {
		d := delivery{id: consumer.NewUUID(), tenant: fmt.Sprintf("t%04d", i%o.Tenants)}
		at, err := m.Index(d.tenant)
		if err != nil {
			return ShardResult{}, err
		}
		copies := 1
		if rng.Float64() < o.DupRate {
			copies = 2
		}
		for range copies {
			parts[partition(d.id, o.Concurrency)] <- d
			perShard[at]++
			total++
		}
	}
	for _, p := range parts {
		close(p)
	}
	workers.Wait()
	elapsed := time.Since(start)
	if e := failed.Load(); e != nil {
		return ShardResult{}, *e
	}
	res := ShardResult{Setup: o.Setup, Shards: len(m.Shards), Deliveries: total, Elapsed: elapsed,
		MsgsPerSec: float64(total) / elapsed.Seconds(), P50: hist.quantile(0.5), P99: hist.quantile(0.99)}
	var self, pg time.Duration
	pgSeen := true
	for i, s := range m.Shards {
		d := take(ctx, s.Pool, apps[i]).Since(before[i])
		if i == 0 {
			self = d.Self
		}
		share := ShardShare{Name: s.Name, Deliveries: perShard[i]}
		if d.BackendsSeen {
			us, secs := cpustat.PerOp(d.Backends, perShard[i]), d.Backends.Seconds()
			share.PgMicros, share.PgSeconds = &us, &secs
			pg += d.Backends
		} else {
			pgSeen = false
		}
		res.PerShard = append(res.PerShard, share)
	}
	res.GoMicros = cpustat.PerOp(self, total)
	if pgSeen {
		us := cpustat.PerOp(pg, total)
		res.PgMicros = &us
	}
	distinct := 0
	for _, s := range m.Shards {
		var rows, keys int
		if err := s.Pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT key) FROM `+biz).Scan(&rows, &keys); err != nil {
			return ShardResult{}, err
		}
		res.CommittedTwice += rows - keys
		distinct += keys
	}
	res.Lost = o.N - distinct
	return res, nil
}

// tenantBiz is the business table of the runs spread by tenant: the tenant is in
// its key, as Citus requires of a table distributed by tenant.
const tenantBiz = "bench_tenant_biz"

// resetTenants makes the business table of a run spread by tenant, distributed by
// tenant and colocated with idem's inbox on Citus, and empties it, the inbox and
// the effects.
func resetTenants(ctx context.Context, pool *pgxpool.Pool, schema string, citus bool) error {
	t := pgx.Identifier{schema, tenantBiz}.Sanitize()
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+t+` (tenant text NOT NULL, id bigserial, key text NOT NULL, payload bytea,
		PRIMARY KEY (tenant, id))`); err != nil {
		return err
	}
	if citus {
		var distributed bool
		if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = $1::regclass)`, t).Scan(&distributed); err != nil {
			return err
		}
		if !distributed {
			if _, err := pool.Exec(ctx, `SELECT create_distributed_table($1, 'tenant', colocate_with => $2)`,
				t, pgx.Identifier{schema, "inbox"}.Sanitize()); err != nil {
				return fmt.Errorf("distribute %s by tenant: %w", t, err)
			}
		}
	}
	_, err := pool.Exec(ctx, `TRUNCATE `+t+`, `+pgx.Identifier{schema, "inbox"}.Sanitize()+`, `+pgx.Identifier{schema, "effects"}.Sanitize())
	return err
}
