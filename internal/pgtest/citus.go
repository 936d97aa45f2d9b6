package pgtest

import (
	"cmp"
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/redact"
	"github.com/idemkit/idem/migrate"
)

// CitusURLVar names the environment variable with the Citus coordinator's URL, as
// scripts/services start citus prints it.
const CitusURLVar = "IDEM_CITUS_URL"

// HowToStartCitus says how to bring up the Citus cluster.
const HowToStartCitus = `start it with:
    eval "$(scripts/services start citus)"
(a Citus coordinator on 127.0.0.1:5460 and two workers on :5461 and :5462, which
exports ` + CitusURLVar + `; the first start builds Citus, a few minutes on 2 cores)`

// citusLock is the lock file of the Citus cluster (see lockFile).
const citusLock = "idem-citus-cluster.lock"

// CitusURL returns the Citus coordinator's URL, failing the test with instructions
// when the variable is unset or the coordinator does not answer.
func CitusURL(tb testing.TB) string {
	tb.Helper()
	u := strings.TrimSpace(os.Getenv(CitusURLVar))
	if u == "" {
		tb.Fatalf("%s is unset; the Citus tests need a Citus cluster\n%s", CitusURLVar, HowToStartCitus)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := pingURL(ctx, u); err != nil {
		tb.Fatal(redact.Text(fmt.Sprintf("the Citus coordinator is not reachable at %s: %v\n%s", u, err, HowToStartCitus), u))
	}
	return u
}

// Citus gives the test a fresh empty schema on the Citus coordinator and a pool
// (opts' MaxConns, default 8, QueryExecMode and Settings) whose search_path is that
// schema; the test creates and distributes its tables in it. The coordinator
// creates the schema on the workers too, and dropping it when the test ends drops
// the tables' shards. The test holds a shared lock on the cluster for its life, so
// a test that crashes a worker (CrashableCitus) never runs beside it.
func Citus(tb testing.TB, opts ...Options) (*pgxpool.Pool, string) {
	tb.Helper()
	lockFile(tb, citusLock, syscall.LOCK_SH)
	return citusSchema(tb, opts)
}

// CitusCtl crashes and starts the workers of a CrashableCitus test.
type CitusCtl struct {
	tb testing.TB
}

// CrashableCitus is Citus for a test that crashes workers: it holds the lock on the
// cluster alone, so it waits for the other Citus tests of every package and they
// wait for it. When the test ends both workers are started again.
func CrashableCitus(tb testing.TB, opts ...Options) (*pgxpool.Pool, string, *CitusCtl) {
	tb.Helper()
	lockFile(tb, citusLock, syscall.LOCK_EX)
	ctl := &CitusCtl{tb: tb}
	// Cleanups run last-in first-out: the workers are up again before the schema
	// is dropped and the lock is released.
	pool, schema := citusSchema(tb, opts)
	tb.Cleanup(func() {
		for n := 1; n <= 2; n++ {
			if err := servicesErr("start", citusWorker(n)); err != nil {
				tb.Error(err)
			}
		}
	})
	return pool, schema, ctl
}

// citusWorker is scripts/services' name of Citus worker n (1 or 2).
func citusWorker(n int) string { return fmt.Sprintf("citus-worker%d", n) }

// CrashWorker stops worker n (1 or 2) with pg_ctl stop -m immediate, as a server
// crash, through scripts/services, which touches only the nodes it started.
func (c *CitusCtl) CrashWorker(n int) {
	c.tb.Helper()
	services(c.tb, "crash", citusWorker(n))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if pingURL(ctx, CitusWorkerURL(c.tb, n)) == nil {
		c.tb.Fatalf("Citus worker %d still answers after scripts/services crash %s; the crash tests need the nodes that scripts/services start citus started", n, citusWorker(n))
	}
}

// StartWorker starts worker n (1 or 2) again and waits until it answers.
func (c *CitusCtl) StartWorker(n int) {
	c.tb.Helper()
	services(c.tb, "start", citusWorker(n))
}

// RestartWorker is pg_ctl restart -m immediate on worker n: CrashWorker, then
// StartWorker.
func (c *CitusCtl) RestartWorker(n int) {
	c.tb.Helper()
	c.CrashWorker(n)
	c.StartWorker(n)
}

// CitusWorkerURL is the URL of worker n (1 or 2): the coordinator's URL with the
// worker's port (CitusWorkerPort).
func CitusWorkerURL(tb testing.TB, n int) string {
	tb.Helper()
	u, port := citusCoordinator(tb)
	u.Host = net.JoinHostPort(u.Hostname(), strconv.Itoa(port+n))
	return u.String()
}

// CitusWorkerPort is the port of worker n (1 or 2), which scripts/services puts at
// the coordinator's port + n.
func CitusWorkerPort(tb testing.TB, n int) int {
	tb.Helper()
	_, port := citusCoordinator(tb)
	return port + n
}

// citusCoordinator is the coordinator's URL, parsed, and its port.
func citusCoordinator(tb testing.TB) (*url.URL, int) {
	tb.Helper()
	coord := CitusURL(tb)
	u, err := url.Parse(coord)
	if err != nil {
		tb.Fatal(redact.Text(fmt.Sprintf("parse %s: %v", CitusURLVar, err), coord))
	}
	port, err := strconv.Atoi(cmp.Or(u.Port(), "5432"))
	if err != nil {
		tb.Fatal(redact.Text(fmt.Sprintf("parse %s's port: %v", CitusURLVar, err), coord))
	}
	return u, port
}

func citusSchema(tb testing.TB, opts []Options) (*pgxpool.Pool, string) {
	tb.Helper()
	var o Options
	if len(opts) > 0 {
		o = opts[0]
	}
	coord := CitusURL(tb)
	schema := NewSchemaName()
	cfg, err := configAt(coord, schema, o, 8)
	if err != nil {
		tb.Fatal(redact.Text(fmt.Sprintf("parse %s: %v", CitusURLVar, err), coord))
	}
	pool := OpenPool(tb, cfg)
	release := CitusDDL(tb)
	_, err = pool.Exec(context.Background(), `CREATE SCHEMA `+pgx.Identifier{schema}.Sanitize())
	release()
	if err != nil {
		tb.Fatal(redact.Text(fmt.Sprintf("create schema %s on the Citus coordinator %s: %v", schema, coord, err), coord))
	}
	tb.Cleanup(func() {
		f, err := lockCitusDDL()
		if err != nil {
			tb.Error(err)
		}
		defer func() { _ = f.Close() }()
		dropOn(tb, coord, schema)
	})
	return pool, schema
}

// CitusTenants returns n tenants named prefix + a number whose rows of schema's
// inbox (and of every table colocated with it) are on worker 1, and n on worker
// 2, from the coordinator's shard placements.
func CitusTenants(tb testing.TB, pool *pgxpool.Pool, schema, prefix string, n int) (w1, w2 []string) {
	tb.Helper()
	table := pgx.Identifier{schema, "inbox"}.Sanitize()
	for i := 0; len(w1) < n || len(w2) < n; i++ {
		if i == 1000 {
			tb.Fatalf("%s's inbox has no %d tenants of each worker among 1000: are its shards on both workers?", schema, n)
		}
		tenant := prefix + strconv.Itoa(i)
		switch w := CitusWorkerOf(tb, pool, table, tenant); {
		case w == 1 && len(w1) < n:
			w1 = append(w1, tenant)
		case w == 2 && len(w2) < n:
			w2 = append(w2, tenant)
		}
	}
	return w1, w2
}

// CitusSetup is Setup on the Citus coordinator: Citus, then the idem tables
// migrated in Citus mode (migrate.Config.Citus), so inbox and effects are
// distributed by tenant and colocated.
func CitusSetup(tb testing.TB, opts ...Options) (*pgxpool.Pool, string) {
	tb.Helper()
	pool, schema := Citus(tb, opts...)
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: schema, Citus: true})
	if err != nil {
		tb.Fatal(err)
	}
	// Citus can still answer with a distributed deadlock (40P01) when the DDL
	// meets another test's traffic on its metadata; the migration rolled back, so
	// it is run again.
	for try := 1; ; try++ {
		release := CitusDDL(tb)
		_, err = m.Up(context.Background())
		release()
		if err == nil || try == 5 || !strings.Contains(err.Error(), "40P01") {
			break
		}
		tb.Logf("migrate the Citus test schema %s, try %d: %v", schema, try, err)
	}
	if err != nil {
		tb.Fatalf("migrate the Citus test schema %s in Citus mode: %v", schema, err)
	}
	return pool, schema
}

// citusDDLLock is the lock file that CitusDDL takes.
const citusDDLLock = "idem-citus-ddl.lock"

// CitusDDL takes the lock on the Citus cluster's DDL, for every test of every
// package on the machine, and returns its release: Citus can answer two schemas'
// distribution at once (create_distributed_table, migrate up --citus) with a
// distributed deadlock on its own metadata, so the tests distribute one schema at
// a time. It is released at the test's end if not before.
func CitusDDL(tb testing.TB) (release func()) {
	tb.Helper()
	f, err := lockCitusDDL()
	if err != nil {
		tb.Fatal(err)
	}
	var once sync.Once
	release = func() { once.Do(func() { _ = f.Close() }) } // closing the file releases the lock
	tb.Cleanup(release)
	return release
}

// lockCitusDDL takes the lock of CitusDDL; closing the file releases it.
func lockCitusDDL() (*os.File, error) {
	f, err := os.OpenFile(filepath.Join(os.TempDir(), citusDDLLock), os.O_CREATE|os.O_RDWR, 0o666)
	if err != nil {
		return nil, fmt.Errorf("lock %s: %w", citusDDLLock, err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("lock %s: %w", citusDDLLock, err)
	}
	return f, nil
}

// Distribute makes the test's table (created in the schema of pool's search_path)
// a distributed table by tenant, colocated with idem's inbox, as a user's business
// table on Citus is.
func Distribute(tb testing.TB, pool *pgxpool.Pool, schema, table string) {
	tb.Helper()
	release := CitusDDL(tb)
	defer release()
	_, err := pool.Exec(context.Background(), `SELECT create_distributed_table($1, 'tenant', colocate_with => $2)`,
		pgx.Identifier{schema, table}.Sanitize(), pgx.Identifier{schema, "inbox"}.Sanitize())
	if err != nil {
		tb.Fatalf("distribute %s.%s by tenant: %v", schema, table, err)
	}
}

// CitusWorkerOf is the worker (1 or 2) that holds tenant's shard of table, a
// distributed table named as regclass reads it (schema-qualified and quoted).
func CitusWorkerOf(tb testing.TB, pool *pgxpool.Pool, table, tenant string) int {
	tb.Helper()
	var port int
	err := pool.QueryRow(context.Background(), `
		SELECT n.nodeport FROM pg_dist_placement p JOIN pg_dist_node n USING (groupid)
		WHERE p.shardid = get_shard_id_for_distribution_column($1::regclass, $2::text)`, table, tenant).Scan(&port)
	if err != nil {
		tb.Fatalf("the Citus worker of tenant %q of %s: %v", tenant, table, err)
	}
	for n := 1; n <= 2; n++ {
		if port == CitusWorkerPort(tb, n) {
			return n
		}
	}
	tb.Fatalf("tenant %q of %s is on port %d, neither Citus worker's", tenant, table, port)
	return 0
}

// RemoteLog holds the commands that a pool's sessions had Citus send to the
// workers (citus.log_remote_commands), as Citus's notices said them.
type RemoteLog struct {
	mu   sync.Mutex
	msgs []string
}

// Matching is the commands so far that contain s.
func (l *RemoteLog) Matching(s string) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, m := range l.msgs {
		if strings.Contains(m, s) {
			out = append(out, m)
		}
	}
	return out
}

// Count is how many of the commands so far contain s.
func (l *RemoteLog) Count(s string) int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	var n int64
	for _, m := range l.msgs {
		if strings.Contains(m, s) {
			n++
		}
	}
	return n
}

// CitusRemoteLog is a pool like base (a Citus pool of this package) whose
// sessions log, as notices kept in the returned RemoteLog, the commands Citus
// sends the workers for them. It is closed when the test ends.
func CitusRemoteLog(tb testing.TB, base *pgxpool.Pool) (*pgxpool.Pool, *RemoteLog) {
	tb.Helper()
	l := &RemoteLog{}
	cfg := base.Config().Copy()
	cfg.ConnConfig.RuntimeParams["citus.log_remote_commands"] = "on"
	cfg.ConnConfig.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		l.mu.Lock()
		l.msgs = append(l.msgs, n.Message)
		l.mu.Unlock()
	}
	return OpenPool(tb, cfg), l
}
