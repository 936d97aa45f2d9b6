package e2e

import (
	"bytes"
	"cmp"
	"context"
	"flag"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/chaos"
	"github.com/idemkit/idem/cmd/idem/internal/payments"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/migrate"
	"github.com/idemkit/idem/shard"
)

// shardTenants is how many tenants a sharded run spreads its payments over.
const shardTenants = 12

// consumerGrace is how long a consumer process lives before the killer may pick it.
const consumerGrace = 3 * time.Second

// N is the number of payments per run: -e2e.n, else IDEM_E2E_N, else 300 (a size
// that keeps `go test -race ./...` on a 2-core machine well inside its budget).
var flagN = flag.Int("e2e.n", envInt("IDEM_E2E_N", 300), "payments per end-to-end run (env IDEM_E2E_N)")

// Seed of the killer and the producer: -e2e.seed, else IDEM_E2E_SEED, else the clock.
var flagSeed = flag.Int64("e2e.seed", int64(envInt("IDEM_E2E_SEED", 0)), "seed (env IDEM_E2E_SEED; 0: from the clock)")

// The mode of every target's batch run: -e2e.batched, else IDEM_E2E_BATCHED
// (group-commit or batch), else each target's own (see targets).
var flagBatched = flag.String("e2e.batched", os.Getenv("IDEM_E2E_BATCHED"), "mode of every batch run: group-commit or batch (env IDEM_E2E_BATCHED)")

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v != 0 {
		return v
	}
	return def
}

func TestMain(m *testing.M) {
	childproc.Main(map[string]childproc.Role{"consumer": runWorker, "dispatcher": runWorker})
	os.Exit(m.Run())
}

// runWorker is a worker process (internal/childproc), a consumer or a dispatcher
// on the schema p["schema"]. It runs until it is killed (SIGKILL, by the parent or
// by an armed crash point) or told to stop (SIGTERM), then exits 0. A consumer
// reads p["endpoint"] in p["mode"] (a payments.Mode), as the peer if p["peer"] is
// "1", and counts its deliveries in the directory p["counts"]; both send their
// emails to the SMTP server p["smtp"]. With p["shards"] (the shards' names,
// comma-separated) and p["shard_urls"] (their clusters' URLs, in the same order) a
// worker serves every shard; without, the database of p["url"] (the Citus
// coordinator), else of DATABASE_URL. A consumer gives each payment its tenant
// when p["tenants"] is "1" (on Citus; on shards always).
func runWorker(ctx context.Context, p childproc.Params) error {
	schema := p["schema"]
	var pool *pgxpool.Pool
	var shards *shard.Map
	if names := p["shards"]; names != "" {
		var err error
		if shards, err = openShards(ctx, strings.Split(names, ","), strings.Split(p["shard_urls"], ","), schema); err != nil {
			return err
		}
		defer func() {
			for _, s := range shards.Shards {
				s.Pool.Close()
			}
		}()
	} else {
		var err error
		if pool, err = payments.NewPool(ctx, cmp.Or(p["url"], pgtest.URL()), payments.ApplicationName(schema), 4); err != nil {
			return err
		}
		defer pool.Close()
	}
	switch p["role"] {
	case "consumer":
		ep, err := payments.ParseEndpoint(p["endpoint"])
		if err != nil {
			return err
		}
		// One byte per delivery as it reaches the handler chain ('r'), and one
		// more, before its ack, for a copy that was suppressed ('s': the handler
		// did not run and it was acked). A write is in the kernel once it
		// returns, so a SIGKILL loses none.
		counts, err := os.OpenFile(filepath.Join(p["counts"], fmt.Sprintf("consumer-%d", os.Getpid())), os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
		if err != nil {
			return err
		}
		defer func() { _ = counts.Close() }()
		onDelivery := func(ran bool, err error) {
			if !ran && err == nil {
				_, _ = counts.Write([]byte{'s'})
			}
		}
		mode := payments.Mode(p["mode"])
		connect := payments.Connect
		if mode != payments.Transactional {
			// A batch needs many messages in flight: several records of a Kafka
			// partition at once, a batched fetch on NATS.
			connect = payments.ConnectBatched
		}
		return retry(ctx, func() error {
			c, err := connect(ep, nil)
			if err != nil {
				return err
			}
			defer c.Close()
			return payments.RunConsumer(ctx, payments.ConsumerConfig{
				Pool: pool, Schema: schema, Shards: shards, ByTenant: p["tenants"] == "1", Subscriber: c.Subscriber, Topic: ep.TopicName(),
				Peer: p["peer"] == "1", PeerSender: &payments.SMTPSender{Addr: p["smtp"]},
				Mode: mode, OnDelivery: onDelivery, OnReceive: func() { _, _ = counts.Write([]byte{'r'}) },
			})
		})
	case "dispatcher":
		return retry(ctx, func() error {
			var d *effects.Dispatcher
			var err error
			if shards != nil {
				d, err = payments.NewShardedDispatcher(shards, p["smtp"], 2*time.Second, nil, nil)
			} else {
				d, err = payments.NewDispatcher(pool, schema, p["smtp"], 2*time.Second, nil, nil)
			}
			if err != nil {
				return err
			}
			return d.Run(ctx)
		})
	}
	return fmt.Errorf("unknown role %q", p["role"])
}

// openShards opens a worker's pools on the clusters of urls, named as the parent's
// map names them, each tagged with the run's ApplicationName so that the parent's
// backend cuts reach them.
func openShards(ctx context.Context, names, urls []string, schema string) (*shard.Map, error) {
	if len(urls) != len(names) {
		return nil, fmt.Errorf("%d shard names for %d URLs", len(names), len(urls))
	}
	m := &shard.Map{}
	for i, url := range urls {
		pool, err := payments.NewPool(ctx, url, payments.ApplicationName(schema), 4)
		if err != nil {
			for _, s := range m.Shards {
				s.Pool.Close()
			}
			return nil, err
		}
		m.Shards = append(m.Shards, shard.Shard{Name: names[i], Pool: pool, Schema: schema})
	}
	return m, nil
}

// retry runs a worker until ctx ends. A worker that fails on its own (a subscribe
// that timed out on a loaded machine, a connection cut at start) runs again, as
// under a supervisor; ten failures in a row end the process with an error (exit
// code 2), which fails the test.
func retry(ctx context.Context, work func() error) error {
	for failures := 0; ; failures++ {
		err := work()
		if ctx.Err() != nil {
			return nil
		}
		fmt.Fprintln(os.Stderr, err)
		if failures == 9 {
			return err
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// proc is a worker process seen from the parent.
type proc struct{ *childproc.Child }

// stderrTail is the worker's last lines of stderr, with the database password
// masked.
func (p proc) stderrTail() string {
	lines := strings.Split(strings.TrimRight(p.Output(), "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-40):], "\n")
}

// startProc starts a worker process in role with params and env; its exit is
// announced on exits.
func startProc(t *testing.T, role string, params childproc.Params, env []string, exits chan<- *proc) *proc {
	t.Helper()
	params["role"] = role
	p := &proc{childproc.Start(t, role, childproc.Options{Params: params, Env: env})}
	go func() {
		<-p.Done()
		exits <- p
	}()
	return p
}

// run is what one end-to-end run did.
type run struct {
	report chaos.Report
	// shards are the reports of a sharded run's shards, whose sum is report,
	// under shardNames.
	shards                 []chaos.Report
	shardNames             []string
	elapsed                time.Duration
	kills, selfKills       map[string]int // SIGKILLs by the killer, and by armed crash points, per role
	restarts, cuts, pubDup int
	// pastBroker is how many of the producer's duplicates the broker stores and
	// delivers: all on Kafka; on NATS the ones sent without Nats-Msg-Id (the
	// server drops the others within its duplicate window).
	pastBroker   int
	ledgerRows   int
	emailsPerKey map[int]int // how many keys got k emails
	// largestCommit is the most keys one transaction committed, and inBatches the
	// keys committed together with others (inbox rows that share their
	// transaction's received_at).
	largestCommit, inBatches int
	// outage is a sharded run's shard outage: per shard, its ledger rows when
	// its cluster crashed and when it was started again, outageFor later.
	outage    []shardOutage
	outageFor time.Duration
	// A Citus run's worker outage: the tenants of the run on each worker and
	// their payments, the worker that crashed, how long it was down (until it
	// answered again), and the ledger rows of each worker's tenants when it
	// crashed, just before it was started again (-1: the worker did not answer),
	// and at the end.
	workerTenants                     map[int][]string
	workerKeys                        map[int]int
	crashedWorker                     int
	workerDownFor                     time.Duration
	workerBefore, workerAt, workerEnd map[int]int
}

// shardOutage is one shard's figures over a run's shard outage.
type shardOutage struct {
	name    string
	crashed bool // this shard's cluster is the one that crashed
	// before and after are its ledger rows when the cluster crashed and when it
	// was started again; left is how many of its payments were not committed
	// yet when it crashed.
	before, after, left int
}

func (r run) summary() string {
	var per []string
	for _, k := range slices.Sorted(maps.Keys(r.emailsPerKey)) {
		per = append(per, fmt.Sprintf("%d key(s) × %d", r.emailsPerKey[k], k))
	}
	return fmt.Sprintf("%s; SIGKILLs by the killer %v, by crash points %v, restarts %d, backend cuts %d, "+
		"producer duplicates %d (%d kept by the broker), duplicates delivered %d, ledger rows %d, "+
		"keys committed in batches %d (largest %d), raw emails per key: %s",
		r.elapsed.Round(100*time.Millisecond), r.kills, r.selfKills, r.restarts, r.cuts,
		r.pubDup, r.pastBroker, r.report.DuplicatesDelivered(), r.ledgerRows,
		r.inBatches, r.largestCommit, strings.Join(per, ", "))
}

// place is a database a run's keys commit in: the one of DATABASE_URL, a shard, or
// the Citus coordinator, with the tenants whose payments it holds.
type place struct {
	name    string // the shard's name; "" for DATABASE_URL
	pool    *pgxpool.Pool
	tenants map[string][]string // tenant ("" on one Postgres) -> its payment keys
}

// database is where a run's keys commit.
type database int

const (
	// onePostgres is the database of DATABASE_URL, without tenants.
	onePostgres database = iota
	// onShards is three shards (see runE2E), the payments spread over
	// shardTenants tenants.
	onShards
	// onCitus is the Citus coordinator of IDEM_CITUS_URL (see runE2E), the
	// payments spread over shardTenants tenants.
	onCitus
)

// target is a broker a run goes through.
type target struct {
	name   string // the subtest's name: kafka-kfake, kafka-external, nats-embedded, nats-external
	broker string // payments.Kafka or payments.NATS
	addr   string // an external broker's address; "" for an in-process one
	// batched is the batch mode of the target's second idem run, fed by a
	// subscriber that holds many messages in flight (payments.ConnectBatched).
	// Each mode runs on one Kafka and one NATS target, and the batch handler on
	// the real Kafka broker.
	batched payments.Mode
}

func (tg target) String() string {
	switch {
	case tg.addr != "" && tg.broker == payments.Kafka:
		return "Kafka at " + tg.addr + " (KAFKA_BROKERS)"
	case tg.addr != "":
		return "NATS JetStream at " + tg.addr + " (NATS_URL)"
	case tg.broker == payments.Kafka:
		return "Kafka (in-process kfake)"
	}
	return "NATS JetStream (embedded nats-server)"
}

// targets are kfake and embedded NATS always, and the real Kafka broker of
// KAFKA_BROKERS and the NATS server of NATS_URL when those are set.
func targets() []target {
	out := []target{{name: "kafka-kfake", broker: payments.Kafka, batched: payments.GroupCommit}}
	if b := os.Getenv("KAFKA_BROKERS"); b != "" {
		out = append(out, target{name: "kafka-external", broker: payments.Kafka, addr: b, batched: payments.Batch})
	}
	out = append(out, target{name: "nats-embedded", broker: payments.NATS, batched: payments.Batch})
	if u := os.Getenv("NATS_URL"); u != "" {
		out = append(out, target{name: "nats-external", broker: payments.NATS, addr: u, batched: payments.GroupCommit})
	}
	return out
}

// runE2E runs one chaos run through tg, through idem in mode or (peer) the
// Deduplicator, on db. onShards (idem only): the payments' tenants are spread
// over three shards: the first two shard clusters of IDEM_SHARD_URLS and a cluster
// of the run's own, which it crashes (pg_ctl stop -m immediate) halfway through and
// starts again once the other shards have committed some (outageMin to outageMax
// later). onCitus (idem only): idem's tables are migrated in Citus mode and the
// ledger is distributed by tenant, colocated with the inbox; the tenants are on
// both workers, and worker 1 crashes (pg_ctl stop -m immediate) halfway through and
// starts again workerOutage later. The run holds the Citus cluster alone
// (pgtest.CrashableCitus) meanwhile.
func runE2E(t *testing.T, tg target, peer bool, mode payments.Mode, n int, seed int64, db database) run {
	t.Helper()
	broker := tg.broker
	var places []*place
	var schema string
	var shardMap *shard.Map
	var own *pgtest.OwnCluster
	var shardURLs []string
	var citusPool *pgxpool.Pool
	var citusCtl *pgtest.CitusCtl
	var dbURL string // the workers' database: "" for DATABASE_URL
	if db == onCitus {
		// Before the run's deadline: it waits until no other package's Citus
		// test uses the cluster.
		citusPool, schema, citusCtl = pgtest.CrashableCitus(t, pgtest.Options{MaxConns: 3})
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(150+n/20)*time.Second)
	defer cancel()
	sharded, tenanted := db == onShards, db != onePostgres
	require.False(t, peer && tenanted, "the peer runs on one database, without tenants")
	switch db {
	case onShards:
		// The shared clusters are used by every package's tests at once: the
		// shard that goes down is a cluster of this run's own.
		own = pgtest.StartOwnCluster(t)
		shardURLs = append(slices.Clone(pgtest.ShardURLs(t)[:2]), own.URL)
		shardMap = pgtest.ShardsAt(t, shardURLs, pgtest.Options{MaxConns: 3})
		schema = shardMap.Shards[0].SchemaName()
		for _, s := range shardMap.Shards {
			require.NoError(t, payments.CreateTables(ctx, s.Pool, schema))
			places = append(places, &place{name: s.Name, pool: s.Pool, tenants: map[string][]string{}})
		}
	case onCitus:
		pool := citusPool
		dbURL = pgtest.CitusURL(t)
		m, err := migrate.New(migrate.Config{Pool: pool, Schema: schema, Citus: true})
		require.NoError(t, err)
		release := pgtest.CitusDDL(t)
		_, err = m.Up(ctx)
		release()
		require.NoError(t, err)
		require.NoError(t, payments.CreateTables(ctx, pool, schema))
		pgtest.Distribute(t, pool, schema, "ledger")
		places = []*place{{pool: pool, tenants: map[string][]string{}}}
	default:
		var pool *pgxpool.Pool
		pool, schema = pgtest.Setup(t, pgtest.Options{MaxConns: 3})
		require.NoError(t, payments.CreateTables(ctx, pool, schema))
		places = []*place{{pool: pool, tenants: map[string][]string{}}}
	}
	box, err := payments.StartMailbox("127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = box.Close() })

	ep := payments.Endpoint{Broker: broker, Group: "payments-e2e"}
	switch {
	case broker == payments.NATS && tg.addr != "":
		// A shared server: a subject, stream and durable of this run's own; the
		// stream (and its consumers) is deleted when the test ends.
		ep.Addr, ep.Topic, ep.Group = tg.addr, "idem-e2e-"+schema, "idem-e2e-"+schema
		t.Cleanup(func() {
			if err := payments.DeleteTopic(context.Background(), ep, ep.Topic); err != nil {
				t.Logf("delete the stream of %s on %s: %v", ep.Topic, ep.Addr, err)
			}
		})
	case broker == payments.NATS:
		srv, err := payments.StartNATS(t.TempDir(), -1)
		require.NoError(t, err)
		t.Cleanup(func() { srv.Shutdown(); srv.WaitForShutdown() })
		ep.Addr = srv.ClientURL()
	case tg.addr != "":
		// A shared broker: a topic and a group of this run's own, made before the
		// producer publishes and deleted when the test ends.
		ep.Addr, ep.Topic, ep.Group = tg.addr, "idem-e2e-"+schema, "idem-e2e-"+schema
		require.NoError(t, payments.CreateTopic(ctx, ep, ep.Topic))
		t.Cleanup(func() {
			if err := payments.DeleteTopic(context.Background(), ep, ep.Topic); err != nil {
				t.Logf("delete topic %s on %s: %v", ep.Topic, ep.Addr, err)
			}
		})
	default:
		c, err := payments.StartKafka()
		require.NoError(t, err)
		t.Cleanup(c.Close)
		ep.Addr = strings.Join(c.ListenAddrs(), ",")
	}
	topic := ep.TopicName()
	t.Logf("broker: %s; topic %s, group %s", tg, topic, ep.Group)

	// The producer: n payments, 30% of them sent twice, before any consumer runs
	// (the stream or topic holds them; consumers join while the killer runs). On
	// NATS every other copy goes without Nats-Msg-Id (payments.Connect), past the
	// server's duplicate window, so that idem sees producer duplicates there too.
	connect := payments.Connect
	if mode != payments.Transactional {
		connect = payments.ConnectBatched // records keyed by payment, so many are in flight
	}
	conn, err := connect(ep, nil)
	require.NoError(t, err)
	pub, err := chaos.NewPublisher(conn.Publisher, chaos.PublisherConfig{Seed: seed, DuplicateProbability: 0.3})
	require.NoError(t, err)
	keys := make([]string, 0, n)
	tenantOf := make(map[string]string, n)
	for len(keys) < n {
		batch := make([]*message.Message, 0, 100)
		for len(batch) < cap(batch) && len(keys)+len(batch) < n {
			i := len(keys) + len(batch)
			if tenanted {
				batch = append(batch, payments.NewTenantMessage(int64(100+i), fmt.Sprintf("tenant-%02d", i%shardTenants)))
			} else {
				batch = append(batch, payments.NewMessage(int64(100+i)))
			}
		}
		require.NoError(t, pub.Publish(topic, batch...))
		for _, m := range batch {
			keys = append(keys, m.UUID)
			tenant, at := m.Metadata.Get(payments.TenantMetadata), 0
			tenantOf[m.UUID] = tenant
			if sharded {
				at, err = shardMap.Index(tenant)
				require.NoError(t, err)
			}
			places[at].tenants[tenant] = append(places[at].tenants[tenant], m.UUID)
		}
	}
	for _, pl := range places {
		require.NotEmpty(t, pl.tenants, "shard %s got no tenant: spread the tenants wider", pl.name)
	}
	r := run{pubDup: int(pub.Duplicates()), kills: map[string]int{}, selfKills: map[string]int{}}
	if db == onCitus {
		r.workerTenants = citusWorkers(t, places[0].pool, schema, slices.Collect(maps.Keys(places[0].tenants)))
		require.NotEmpty(t, r.workerTenants[1], "no tenant on Citus worker 1: spread the tenants wider")
		require.NotEmpty(t, r.workerTenants[2], "no tenant on Citus worker 2: spread the tenants wider")
		r.workerKeys = map[int]int{}
		for w, ts := range r.workerTenants {
			for _, tenant := range ts {
				r.workerKeys[w] += len(places[0].tenants[tenant])
			}
		}
		r.crashedWorker = 1
	}
	r.pastBroker = r.pubDup
	if broker == payments.NATS {
		r.pastBroker = int(conn.PastWindow())
	}
	conn.Close()

	peerFlag := "0"
	if peer {
		peerFlag = "1"
	}
	rng := rand.New(rand.NewPCG(uint64(seed), 2))
	countsDir := t.TempDir()
	envOf := func(role string) []string {
		// Armed crash points: about 1% of commits and sends at the CI size, fewer
		// at large N (about 30 deaths of each kind per run), so that restarts do
		// not dominate a long run; the killer adds its own kills at a fixed rate.
		p := min(0.01, 30/float64(n))
		crash := fmt.Sprintf("after-commit-before-ack:%g,before-commit:%g", p, p/2)
		if role == "dispatcher" {
			crash = fmt.Sprintf("mid-send:%g", p)
		}
		return []string{chaos.EnvCrash + "=" + crash, chaos.EnvCrashSeed + "=" + strconv.FormatInt(rng.Int64(), 10)}
	}
	paramsOf := func() childproc.Params {
		params := childproc.Params{"endpoint": ep.String(), "schema": schema, "smtp": box.Addr(), "peer": peerFlag,
			"counts": countsDir, "mode": string(mode)}
		if sharded {
			params["shards"] = strings.Join(shardMap.Names(), ",")
			params["shard_urls"] = strings.Join(shardURLs, ",")
		}
		if db == onCitus {
			params["url"], params["tenants"] = dbURL, "1"
		}
		return params
	}
	exits := make(chan *proc, 16)
	roles := []string{"consumer", "consumer", "consumer", "dispatcher", "dispatcher"}
	if peer {
		roles = roles[:3] // the peer sends its emails from the handler
	}
	live := make([]*proc, len(roles))
	for i, role := range roles {
		live[i] = startProc(t, role, paramsOf(), envOf(role), exits)
	}
	killed := map[*proc]bool{}
	// done is set once the work is done (idem: everything settled; the peer: the
	// figures have stopped moving). The killer then stops, so that a Kafka group
	// whose members keep dying before they commit does not keep the broker from
	// draining, and the run ends when the broker has nothing left for the group.
	done := false

	audit := func(ctx context.Context) (total chaos.Report, each []chaos.Report, err error) {
		return auditPlaces(ctx, places, schema, box, peer)
	}
	start := time.Now()
	cutAt := []int{n / 3, 2 * n / 3}
	killer := time.NewTimer(500 * time.Millisecond)
	auditTick := time.NewTicker(250 * time.Millisecond)
	defer auditTick.Stop()
	var last figures
	lastChange, lastLog := time.Now(), time.Now()
	// The shard outage: the own cluster (the map's last shard) crashes once the
	// first cut is done and half of the payments are committed, and starts again
	// once the other shards have committed some while it was down.
	ownAt := len(places) - 1
	// The Citus worker outage: worker 1 crashes at the same point, and starts
	// again workerOutage later.
	var outageStart time.Time
	down := false
loop:
	for {
		select {
		case <-ctx.Done():
			rep, _, _ := audit(context.Background())
			t.Fatalf("%s run did not settle in time; last report:\n%s", tg, rep)
		case p := <-exits:
			switch {
			case killed[p]:
				r.kills[p.Role]++
			case p.Killed():
				r.selfKills[p.Role]++
			default:
				t.Fatalf("%s process exited on its own (%v):\n%s", p.Role, p.State(), p.stderrTail())
			}
			i := slices.Index(live, p)
			live[i] = startProc(t, p.Role, paramsOf(), envOf(p.Role), exits)
			r.restarts++
		case <-killer.C:
			// A consumer is a target once it has lived consumerGrace: a Kafka group
			// whose members die faster than it can rebalance never moves (each death
			// costs a session timeout and a rebalance), which is a fact about Kafka,
			// not a finding about idem. Dispatchers are targets at any age.
			var targets []*proc
			for _, p := range live {
				if p.Role != "consumer" || time.Since(p.Started) >= consumerGrace {
					targets = append(targets, p)
				}
			}
			if len(targets) > 0 && !done {
				p := targets[rng.IntN(len(targets))]
				killed[p] = true
				_ = p.Kill() // SIGKILL
			}
			killer.Reset(time.Duration(350+rng.IntN(300)) * time.Millisecond)
		case <-auditTick.C:
			if down && citusCtl != nil {
				if time.Since(outageStart) < workerOutage {
					continue
				}
				r.workerAt = workerLedgers(ctx, t, places[0].pool, r.workerTenants)
				citusCtl.StartWorker(r.crashedWorker)
				r.workerDownFor = time.Since(outageStart)
				// The coordinator's backends still hold their connections to the
				// worker's old server.
				places[0].pool.Reset()
				down = false
				t.Logf("Citus worker %d answers again after %s", r.crashedWorker, r.workerDownFor.Round(100*time.Millisecond))
				continue
			}
			if down {
				if time.Since(outageStart) < outageMin {
					continue
				}
				// What the other shards committed while it was down. It stays
				// down until each of them with payments left has committed a few
				// (a consumer's death, at a crash point or by the killer, holds
				// the whole group up for a rebalance), outageMax at most; then it
				// starts again, and its own figure is read.
				waiting := false
				for i, pl := range places {
					if i != ownAt {
						o := &r.outage[i]
						o.after = ledgerOf(ctx, t, pl)
						waiting = waiting || o.after-o.before < min(3, o.left)
					}
				}
				if waiting && time.Since(outageStart) < outageMax {
					continue
				}
				r.outageFor = time.Since(outageStart)
				own.Start()
				places[ownAt].pool.Reset() // its connections died with the server
				r.outage[ownAt].after = ledgerOf(ctx, t, places[ownAt])
				down = false
				t.Logf("shard %s started again after %s", places[ownAt].name, time.Since(outageStart).Round(100*time.Millisecond))
				continue
			}
			// Cheap figures first: the full audit reads every inbox and effect row,
			// which at large N would slow the run it measures.
			fig, err := placeFigures(ctx, places)
			if err != nil {
				continue // a backend cut can hit the parent's pool too
			}
			fig.sends = box.Total()
			for len(cutAt) > 0 && fig.ledger >= cutAt[0] {
				cutAt = cutAt[1:]
				// Every database's workers lose their connections: on a shard map,
				// each shard's at once.
				for _, pl := range places {
					cut, err := payments.TerminateBackends(ctx, pl.pool, schema)
					require.NoError(t, err)
					if pl.name != "" {
						t.Logf("cut %d backends on shard %s", cut, pl.name)
					}
				}
				r.cuts++
			}
			if own != nil && outageStart.IsZero() && r.cuts >= 1 && fig.ledger >= n/2 {
				for i, pl := range places {
					before := ledgerOf(ctx, t, pl)
					keys := 0
					for _, k := range pl.tenants {
						keys += len(k)
					}
					r.outage = append(r.outage, shardOutage{name: pl.name, crashed: i == ownAt, before: before, left: keys - before})
				}
				own.Crash()
				outageStart, down = time.Now(), true
				t.Logf("shard %s crashed (pg_ctl stop -m immediate) at %d/%d ledger rows", places[ownAt].name, fig.ledger, n)
				continue
			}
			if citusCtl != nil && outageStart.IsZero() && r.cuts >= 1 && fig.ledger >= n/2 {
				r.workerBefore = workerLedgers(ctx, t, places[0].pool, r.workerTenants)
				citusCtl.CrashWorker(r.crashedWorker)
				outageStart, down = time.Now(), true
				t.Logf("Citus worker %d crashed (pg_ctl stop -m immediate) at %d/%d ledger rows", r.crashedWorker, fig.ledger, n)
				continue
			}
			if time.Since(lastLog) > 5*time.Second {
				lastLog = time.Now()
				t.Logf("%s: ledger rows %d/%d, effects pending %d, emails %d, kills %v/%v", time.Since(start).Round(time.Second), fig.ledger, n, fig.pending, fig.sends, r.kills, r.selfKills)
			}
			if fig != last {
				last, lastChange = fig, time.Now()
			}
			if len(cutAt) > 0 {
				continue
			}
			// idem's work is done when everything is settled. The peer can lose
			// messages for good, so its work is done when the figures have stopped
			// moving. Either run ends when the broker has nothing left for the
			// group (every message acked and committed), so that every duplicate
			// the broker stored was delivered and counted.
			if !done && !peer && fig.ledger >= n && fig.pending == 0 {
				rep, _, err := audit(ctx)
				// A key committed twice, or on a database that is not its tenant's,
				// stays so: fail now rather than at the run's deadline.
				if err == nil && (rep.CommittedTwice > 0 || rep.Unexpected > 0) {
					t.Fatalf("%s run: a key committed twice or on another tenant's database:\n%s", tg, rep)
				}
				done = err == nil && rep.OK() && rep.Settled() && rep.CommittedOnce == n
			}
			if peer && time.Since(lastChange) > 3*time.Second {
				done = true
			}
			if done {
				if backlog, err := payments.Backlog(ctx, ep, topic); err == nil && backlog == 0 {
					break loop
				}
			}
		}
	}
	r.elapsed = time.Since(start)
	killer.Stop()
	for _, p := range live {
		_ = p.Signal(syscall.SIGTERM)
	}
	for _, p := range live {
		select {
		case <-p.Done():
		case <-time.After(20 * time.Second):
			_ = p.Kill()
			<-p.Done()
		}
	}
	r.report, r.shards, err = audit(context.Background())
	require.NoError(t, err)
	if sharded {
		r.shardNames = shardMap.Names()
	}
	if db == onCitus {
		r.workerEnd = workerLedgers(ctx, t, places[0].pool, r.workerTenants)
	}
	r.report.Deliveries, r.report.DuplicatesSuppressed = countDeliveries(t, countsDir)
	for _, pl := range places {
		r.ledgerRows += pgtest.Count(t, pl.pool, payments.LedgerRowsSQL(schema))
		if !peer {
			// A transaction's rows share its now(): rows per received_at are keys per
			// commit (and a commit is on one database).
			var largest, inBatches int
			require.NoError(t, pl.pool.QueryRow(ctx, `SELECT coalesce(max(n), 0), coalesce(sum(n) FILTER (WHERE n > 1), 0)
				FROM (SELECT count(*) AS n FROM inbox GROUP BY received_at) AS commits`).Scan(&largest, &inBatches))
			r.largestCommit, r.inBatches = max(r.largestCommit, largest), r.inBatches+inBatches
		}
	}
	counts, _ := box.Counts(ctx)
	r.emailsPerKey = map[int]int{}
	for _, k := range keys {
		r.emailsPerKey[counts[payments.MailKey(tenantOf[k], payments.EmailKey(k))]]++
	}
	return r
}

// auditPlaces audits a run's databases: each tenant of each on its own (inbox rows,
// effects and sends scoped by tenant), summed per database, and the databases
// summed. A database's ledger rows count for its own tenants' keys; a key committed
// on another database's tenant's shard is an unexpected key there and a lost one
// on its own shard.
func auditPlaces(ctx context.Context, places []*place, schema string, box *payments.Mailbox, peer bool) (total chaos.Report, each []chaos.Report, err error) {
	sends, err := box.Counts(ctx)
	if err != nil {
		return total, nil, err
	}
	for _, pl := range places {
		a, err := chaos.NewAuditor(chaos.AuditorConfig{Pool: pl.pool, Schema: schema})
		if err != nil {
			return total, nil, err
		}
		ledger := map[string]int{}
		rows, err := pl.pool.Query(ctx, payments.LedgerCountsSQL(schema))
		if err != nil {
			return total, nil, err
		}
		var key string
		var count int64
		if _, err := pgx.ForEachRow(rows, []any{&key, &count}, func() error { ledger[key] += int(count); return nil }); err != nil {
			return total, nil, err
		}
		owner := map[string]string{} // key -> tenant, for this database's tenants
		for tenant, keys := range pl.tenants {
			for _, k := range keys {
				owner[k] = tenant
			}
		}
		var tenants []chaos.Report
		for _, tenant := range slices.Sorted(maps.Keys(pl.tenants)) {
			keys := pl.tenants[tenant]
			q := payments.AuditQuery(schema, keys, func(context.Context) (map[string]int, error) {
				mine := map[string]int{}
				for _, k := range keys {
					if n, ok := sends[payments.MailKey(tenant, payments.EmailKey(k))]; ok {
						mine[payments.EmailKey(k)] = n
					}
				}
				return mine, nil
			}, peer)
			q.Tenant, q.BusinessSQL = tenant, ""
			q.BusinessCount = func(context.Context) (map[string]int, error) {
				mine := map[string]int{}
				for k, n := range ledger {
					if t, ok := owner[k]; !ok || t == tenant {
						mine[k] = n
					}
				}
				return mine, nil
			}
			rep, err := a.Report(ctx, q)
			if err != nil {
				return total, nil, err
			}
			// Unexpected keys are the database's, not each tenant's: count them once.
			if len(tenants) > 0 {
				rep.Unexpected = 0
			}
			tenants = append(tenants, rep)
		}
		each = append(each, chaos.Report{Consumer: payments.Consumer}.Add(tenants...))
	}
	return chaos.Report{Consumer: payments.Consumer}.Add(each...), each, nil
}

// beside prints reports side by side, each column under its title.
func beside(titles []string, reps ...chaos.Report) string {
	reps = slices.Clone(reps)
	for i := range reps {
		reps[i].Consumer = titles[i]
	}
	return reps[0].Beside(reps[1:]...)
}

// A sharded run's own cluster stays down outageMin at least, and then until the
// other shards have committed a few payments, outageMax at most.
const (
	outageMin = 3 * time.Second
	outageMax = 30 * time.Second
)

// workerOutage is how long a Citus run's worker stays down.
const workerOutage = 3 * time.Second

// citusWorkers says which of tenants each Citus worker (1 or 2) holds, by the
// placement of the ledger's shard for the tenant.
func citusWorkers(t *testing.T, pool *pgxpool.Pool, schema string, tenants []string) map[int][]string {
	t.Helper()
	out := map[int][]string{}
	for _, tenant := range slices.Sorted(slices.Values(tenants)) {
		w := pgtest.CitusWorkerOf(t, pool, pgx.Identifier{schema, "ledger"}.Sanitize(), tenant)
		out[w] = append(out[w], tenant)
	}
	return out
}

// workerLedgers counts the ledger rows of each Citus worker's tenants; a worker
// that does not answer counts -1.
func workerLedgers(ctx context.Context, t *testing.T, pool *pgxpool.Pool, tenants map[int][]string) map[int]int {
	t.Helper()
	out := map[int]int{}
	for w, ts := range tenants {
		for _, tenant := range ts {
			var n int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM ledger WHERE tenant = $1`, tenant).Scan(&n); err != nil {
				out[w] = -1
				break
			}
			out[w] += n
		}
	}
	return out
}

// ledgerOf counts a database's ledger rows.
func ledgerOf(ctx context.Context, t *testing.T, pl *place) int {
	t.Helper()
	var n int
	require.NoError(t, pl.pool.QueryRow(ctx, `SELECT count(*) FROM ledger`).Scan(&n), "shard %s", pl.name)
	return n
}

// placeFigures sums the cheap progress figures over a run's databases.
func placeFigures(ctx context.Context, places []*place) (figures, error) {
	var fig figures
	for _, pl := range places {
		var ledger, pending int
		err := pl.pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM ledger),
			(SELECT count(*) FROM effects WHERE state = 'pending')`).Scan(&ledger, &pending)
		if err != nil {
			return fig, err
		}
		fig.ledger, fig.pending = fig.ledger+ledger, fig.pending+pending
	}
	return fig, nil
}

// countDeliveries sums what the consumer processes of a run counted: every
// delivery that reached a handler chain, and the copies suppressed.
func countDeliveries(t *testing.T, dir string) (deliveries, suppressed int64) {
	t.Helper()
	files, err := os.ReadDir(dir)
	require.NoError(t, err)
	for _, f := range files {
		b, err := os.ReadFile(filepath.Join(dir, f.Name()))
		require.NoError(t, err)
		deliveries += int64(bytes.Count(b, []byte{'r'}))
		suppressed += int64(bytes.Count(b, []byte{'s'}))
	}
	return deliveries, suppressed
}

// figures are the cheap progress figures of a run.
type figures struct{ ledger, pending, sends int }

// TestSIGKILLEndToEnd runs the suite on each broker through idem, then through
// the peer, and prints the reports side by side; then once more through idem in
// the target's batch mode (group commit, or a batch handler), fed by a subscriber
// that holds many messages in flight: MaxInFlightPerPartition 16 on Kafka, a
// batched fetch on NATS. The subtests name the broker: kafka-kfake (in-process),
// kafka-external (KAFKA_BROKERS, when set), nats-embedded and nats-external
// (NATS_URL, when set). Then shards (IDEM_SHARD_URLS) and citus (IDEM_CITUS_URL),
// through kfake, each with an outage of its own.
func TestSIGKILLEndToEnd(t *testing.T) {
	n := *flagN
	seed := *flagSeed
	if seed == 0 {
		seed = time.Now().UnixNano() % 1_000_000
	}
	t.Logf("N=%d seed=%d (rerun with IDEM_E2E_N=%d IDEM_E2E_SEED=%d)", n, seed, n, seed)
	for _, tg := range targets() {
		if *flagBatched != "" {
			tg.batched = payments.Mode(*flagBatched)
		}
		t.Run(tg.name, func(t *testing.T) {
			var idem, peer run
			t.Run("idem", func(t *testing.T) {
				idem = runE2E(t, tg, false, payments.Transactional, n, seed, onePostgres)
				t.Logf("idem on %s: %s\n%s", tg, idem.summary(), idem.report)
				requireExactlyOnce(t, idem, n)
			})
			t.Run("deduplicator", func(t *testing.T) {
				peer = runE2E(t, tg, true, payments.Transactional, n, seed, onePostgres)
				t.Logf("Watermill Deduplicator on %s: %s\n%s", tg, peer.summary(), peer.report)
			})
			if idem.report.Messages > 0 && peer.report.Messages > 0 {
				t.Logf("SIGKILL end-to-end run on %s, N=%d, seed %d:\n%s", tg, n, seed,
					beside([]string{"idem", "watermill-deduplicator"}, idem.report, peer.report))
			}
			t.Run("idem-"+string(tg.batched), func(t *testing.T) {
				r := runE2E(t, tg, false, tg.batched, n, seed, onePostgres)
				t.Logf("idem (%s, batches fed by the subscriber) on %s: %s\n%s", tg.batched, tg, r.summary(), r.report)
				requireExactlyOnce(t, r, n)
				// Otherwise the run proved nothing about batches.
				require.Greater(t, r.largestCommit, 1, "no transaction committed more than one key")
			})
		})
	}
	// Once more over a shard map: the payments of shardTenants tenants, spread by
	// the hash route over the shard clusters of IDEM_SHARD_URLS, through kfake in
	// group-commit mode (each consumer process splits its batches per shard); every
	// consumer and dispatcher process serves every shard, and each cut cuts every
	// shard's backends.
	t.Run("shards", func(t *testing.T) {
		tg := target{name: "kafka-kfake", broker: payments.Kafka}
		mode := payments.GroupCommit
		if *flagBatched != "" {
			mode = payments.Mode(*flagBatched)
		}
		r := runE2E(t, tg, false, mode, n, seed, onShards)
		t.Logf("idem (%s) over %d shards on %s: %s", mode, len(r.shards), tg, r.summary())
		t.Logf("SIGKILL end-to-end run over %d shards on %s, N=%d, seed %d, %d tenants:\n%s", len(r.shards), tg, n, seed, shardTenants,
			beside(append(slices.Clone(r.shardNames), "all shards"), append(slices.Clone(r.shards), r.report)...))
		requireExactlyOnce(t, r, n)
		for i, rep := range r.shards {
			require.Positive(t, rep.Messages, "shard %s got no payments", r.shardNames[i])
			require.Equal(t, rep.Messages, rep.CommittedOnce, "shard %s", r.shardNames[i])
		}
		// The outage: the crashed shard's tenants waited, the others went on.
		require.Len(t, r.outage, len(r.shards), "the shard outage did not happen")
		// On Kafka a partition is read in order: a shard whose last payments all wait
		// behind the crashed shard's records (nacked, at the head of their
		// partitions, beyond the 16 in flight) commits none until the crashed shard is
		// back, so the run asks that the other shards together kept committing.
		working, committed := 0, 0
		for _, o := range r.outage {
			if o.crashed {
				t.Logf("shard outage: shard %s, down %s: ledger rows %d when it crashed with %d of its payments left, %d read once it answered again (its tenants' backlog commits as soon as it does)",
					o.name, r.outageFor.Round(100*time.Millisecond), o.before, o.left, o.after)
				continue
			}
			t.Logf("shard outage: shard %s committed %d payments while the other was down (ledger rows %d when it crashed, %d when it was started again; %d of its payments were left)",
				o.name, o.after-o.before, o.before, o.after, o.left)
			if o.left == 0 {
				continue
			}
			working++
			committed += o.after - o.before
		}
		require.Positive(t, working, "no other shard had payments left when the shard crashed")
		require.Positive(t, committed, "the other shards, with payments left, committed none while the crashed shard was down")
		require.Greater(t, r.largestCommit, 1, "no transaction committed more than one key")
	})
	// Once more on Citus: idem's tables migrated in Citus mode on the coordinator
	// of IDEM_CITUS_URL, the ledger distributed by tenant and colocated with the
	// inbox, the payments of shardTenants tenants on both workers, through kfake in
	// group-commit mode (batches split by tenant); the dispatchers have no Tenant
	// and drain every tenant, each cut cuts the coordinator's backends, and worker
	// 1 crashes halfway through and starts again.
	t.Run("citus", func(t *testing.T) {
		tg := target{name: "kafka-kfake", broker: payments.Kafka}
		mode := payments.GroupCommit
		if *flagBatched != "" {
			mode = payments.Mode(*flagBatched)
		}
		r := runE2E(t, tg, false, mode, n, seed, onCitus)
		t.Logf("idem (%s) on Citus on %s: %s", mode, tg, r.summary())
		t.Logf("SIGKILL end-to-end run on Citus (a coordinator, two workers) on %s, N=%d, seed %d, %d tenants:\n%s", tg, n, seed, shardTenants, r.report)
		for w := 1; w <= 2; w++ {
			t.Logf("Citus worker %d: %d tenants, %d payments; their ledger rows: %d when worker %d crashed, %d %s after, as it was started again (-1: down), %d at the end",
				w, len(r.workerTenants[w]), r.workerKeys[w], r.workerBefore[w], r.crashedWorker, r.workerAt[w], workerOutage, r.workerEnd[w])
		}
		t.Logf("Citus worker %d was down %s, until it answered again", r.crashedWorker, r.workerDownFor.Round(100*time.Millisecond))
		requireExactlyOnce(t, r, n)
		require.Positive(t, r.workerDownFor, "the worker outage did not happen")
		for w := 1; w <= 2; w++ {
			require.Equal(t, r.workerKeys[w], r.workerEnd[w], "ledger rows of Citus worker %d's tenants", w)
		}
		require.Greater(t, r.largestCommit, 1, "no transaction committed more than one key")
	})
}

// requireExactlyOnce checks an idem run: every payment committed once, every
// receipt emailed, repeated only after a dispatcher death, under kills and cuts.
func requireExactlyOnce(t *testing.T, r run, n int) {
	t.Helper()
	rep := r.report
	require.NoError(t, rep.Err(), "\n%s", rep)
	require.Equal(t, n, r.ledgerRows, "ledger rows")
	require.Zero(t, rep.Lost)
	require.Zero(t, rep.CommittedTwice)
	require.Zero(t, rep.Unexpected, "keys committed that no tenant of their database published (on a shard map: committed on the wrong shard)")
	require.Equal(t, n, rep.EffectsDone)
	require.Equal(t, n, rep.SendsOnce+rep.SendsRepeated, "every key received by email")
	require.Zero(t, r.emailsPerKey[0], "keys never emailed")
	require.GreaterOrEqual(t, r.cuts, 2)
	require.Positive(t, r.kills["consumer"]+r.kills["dispatcher"])
	// A key is emailed more than once only when a send was cut by a kill: each
	// dead dispatcher had at most 8 claims (4 sending, 4 waiting) a database.
	dispatcherDeaths := r.kills["dispatcher"] + r.selfKills["dispatcher"]
	require.LessOrEqual(t, rep.SendsRepeated, 8*max(1, len(r.shards))*dispatcherDeaths, "repeated sends without a dispatcher death to explain them")
	// Every duplicate the broker stored reached idem: the run ends with nothing
	// left for the group, and a delivery is counted before its handler chain
	// runs, so before its ack. On NATS that is every other copy of the
	// producer's (the rest the server drops).
	require.GreaterOrEqual(t, rep.DuplicatesDelivered(), int64(r.pastBroker), "duplicates delivered, against the producer's copies the broker kept")
	require.GreaterOrEqual(t, 2*r.pastBroker, r.pubDup, "at least half of the producer's duplicates pass the broker")
}
