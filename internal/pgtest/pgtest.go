// Package pgtest gives each test its own schema on a real Postgres, migrated and
// dropped afterwards, so tests run in parallel and leave nothing behind.
//
// It is test support: only _test.go files import it, and it is the one package
// under internal/ that imports a public idem package (migrate, to build the
// schema), which the import-rules test allows for it alone.
//
// The database is DATABASE_URL, or DefaultURL. Without a reachable Postgres the test
// fails with a message that says how to start one; it is never skipped. Messages
// never show the database password: it is masked (internal/redact). The shard
// tests' clusters are IDEM_SHARD_URLS (Shards) and the Citus tests' coordinator
// IDEM_CITUS_URL (Citus), each failing the same way when missing.
package pgtest

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/redact"
	"github.com/idemkit/idem/migrate"
)

// DefaultURL is the test database when DATABASE_URL is unset.
const DefaultURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// URL is the test database's URL.
func URL() string { return cmp.Or(os.Getenv("DATABASE_URL"), DefaultURL) }

// HowToStart says how to bring up a Postgres for the tests.
const HowToStart = `start one with:
    docker compose up -d postgres
or, on a machine with a local cluster:
    pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start
or point DATABASE_URL at a server you have`

var reachable struct {
	once sync.Once
	err  error
}

// Require fails the test at once, with instructions, if Postgres is unreachable.
func Require(tb testing.TB) {
	tb.Helper()
	reachable.once.Do(func() { reachable.err = ping(URL()) })
	if reachable.err != nil {
		tb.Fatal(unreachable(URL(), reachable.err))
	}
}

// ping connects to url and pings it, within 5 s.
func ping(url string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return pingURL(ctx, url)
}

// pingURL connects to url and pings it.
func pingURL(ctx context.Context, url string) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close(ctx) }()
	return conn.Ping(ctx)
}

// unreachable is Require's message for a Postgres at url that failed with err:
// where it looked (password masked), why, and how to start one.
func unreachable(url string, err error) string {
	return redact.Text(fmt.Sprintf("Postgres is not reachable at %s: %v\n%s", url, err, HowToStart), url)
}

// fatalf fails tb with a message whose database password is masked.
func fatalf(tb testing.TB, format string, args ...any) {
	tb.Helper()
	tb.Fatal(redact.Text(fmt.Sprintf(format, args...), URL()))
}

// NewSchemaName returns a fresh schema name for a test.
func NewSchemaName() string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return "t_" + hex.EncodeToString(b)
}

// Options tune Setup.
type Options struct {
	// MaxConns caps the test's pool (default 8). Postgres allows 100 connections in
	// all, and tests of several packages run at once.
	MaxConns int32
	// NoMigrate leaves the schema empty.
	NoMigrate bool
	// QueryExecMode, when set, is the pool's pgx.QueryExecMode (pgx's default is
	// QueryExecModeCacheStatement).
	QueryExecMode pgx.QueryExecMode
	// Settings are session settings for the pool's connections, such as
	// {"default_transaction_isolation": "serializable"}, as a role or database
	// could have them.
	Settings map[string]string
}

// QueryExecModes are pgx's query modes, each of which idem must work in: the
// default prepares and caches statements; exec and simple protocol are what users
// behind PgBouncer in transaction mode choose (pgx then knows no parameter types,
// and sends a []byte as bytea).
var QueryExecModes = []pgx.QueryExecMode{
	pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe, pgx.QueryExecModeDescribeExec,
	pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol,
}

// Setup creates a fresh schema with the idem tables and a pool whose search_path is
// that schema. Both go away when the test ends.
func Setup(tb testing.TB, opts ...Options) (*pgxpool.Pool, string) {
	tb.Helper()
	Require(tb)
	var o Options
	if len(opts) > 0 {
		o = opts[0]
	}
	schema := NewSchemaName()
	pool := NewPoolWith(tb, schema, o)
	ctx := context.Background()
	if !o.NoMigrate {
		m, err := migrate.New(migrate.Config{Pool: pool, Schema: schema})
		if err != nil {
			fatalf(tb, "%v", err)
		}
		if _, err := m.Up(ctx); err != nil {
			fatalf(tb, "migrate test schema: %v", err)
		}
	} else if _, err := pool.Exec(ctx, `CREATE SCHEMA `+schema); err != nil {
		fatalf(tb, "create test schema: %v", err)
	}
	tb.Cleanup(func() { DropSchema(tb, schema) })
	return pool, schema
}

// NewPool opens a pool on the test database with search_path set to schema.
func NewPool(tb testing.TB, schema string, maxConns int32) *pgxpool.Pool {
	tb.Helper()
	return NewPoolWith(tb, schema, Options{MaxConns: maxConns})
}

// NewPoolWith is NewPool with opts' MaxConns (default 8), QueryExecMode and
// Settings.
func NewPoolWith(tb testing.TB, schema string, opts Options) *pgxpool.Pool {
	tb.Helper()
	return OpenPool(tb, PoolConfig(tb, schema, opts))
}

// PoolConfig is the config of a test pool on DATABASE_URL: opts' MaxConns
// (default 8), QueryExecMode and Settings, search_path set to schema, and the
// application_name "idem-test:<schema>" by which tests find their own backends.
// Change it (another user, another address) and open it with OpenPool.
func PoolConfig(tb testing.TB, schema string, opts Options) *pgxpool.Config {
	tb.Helper()
	cfg, err := ConfigFor(schema, opts)
	if err != nil {
		fatalf(tb, "%v", err)
	}
	return cfg
}

// ConfigFor is PoolConfig for code that has no test to fail: a child process
// (internal/childproc) opens its pool on the parent's schema with it.
func ConfigFor(schema string, opts Options) (*pgxpool.Config, error) {
	cfg, err := configAt(URL(), schema, opts, 8)
	if err != nil {
		return nil, fmt.Errorf("parse DATABASE_URL: %w", err)
	}
	return cfg, nil
}

// configAt is the test pool config on url: opts' MaxConns (default maxConns),
// QueryExecMode and Settings, search_path set to schema, and the
// application_name "idem-test:<schema>".
func configAt(url, schema string, opts Options, maxConns int32) (*pgxpool.Config, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = cmp.Or(opts.MaxConns, maxConns)
	if opts.QueryExecMode != 0 {
		cfg.ConnConfig.DefaultQueryExecMode = opts.QueryExecMode
	}
	for k, v := range opts.Settings {
		cfg.ConnConfig.RuntimeParams[k] = v
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.ConnConfig.RuntimeParams["application_name"] = "idem-test:" + schema
	return cfg, nil
}

// OpenPool opens cfg; the pool closes when the test ends.
func OpenPool(tb testing.TB, cfg *pgxpool.Config) *pgxpool.Pool {
	tb.Helper()
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		fatalf(tb, "connect to Postgres: %v\n%s", err, HowToStart)
	}
	tb.Cleanup(pool.Close)
	return pool
}

// DropSchema drops a test schema and everything in it (see dropOn).
func DropSchema(tb testing.TB, schema string) {
	tb.Helper()
	dropOn(tb, URL(), schema)
}

// dropOn drops a test schema on the database at url; a database that is down is
// retried for a while (a crash test may have just restarted it).
func dropOn(tb testing.TB, url, schema string) {
	tb.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		conn, err := pgx.Connect(ctx, url)
		if err == nil {
			_, err = conn.Exec(ctx, `DROP SCHEMA IF EXISTS `+pgx.Identifier{schema}.Sanitize()+` CASCADE`)
			_ = conn.Close(ctx) // the drop's error is the one that matters
		}
		cancel()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			tb.Error(redact.Text(fmt.Sprintf("drop schema %s on %s: %v", schema, url, err), url))
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// TerminateBackends cuts every connection of the pool made for schema, as a crashed
// network or a failover would (pg_terminate_backend). It returns how many it cut.
func TerminateBackends(tb testing.TB, schema string) int {
	tb.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, URL())
	if err != nil {
		fatalf(tb, "connect to Postgres: %v", err)
	}
	defer func() { _ = conn.Close(ctx) }()
	var n int
	err = conn.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
		WHERE application_name = $1 AND pid <> pg_backend_pid()`, "idem-test:"+schema).Scan(&n)
	if err != nil {
		fatalf(tb, "terminate backends: %v", err)
	}
	return n
}

// Count runs a count query and returns the number.
func Count(tb testing.TB, db interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, sql string, args ...any) int {
	tb.Helper()
	var n int
	if err := db.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		fatalf(tb, "%s: %v", strings.TrimSpace(sql), err)
	}
	return n
}

// ApplyMigrations applies idem's migrations from to to (both included, 1-based),
// the files as they are, into the schema of pool's search_path, as a migration
// tool of one's own applies them; 1 to n makes a schema at an older level.
func ApplyMigrations(tb testing.TB, pool *pgxpool.Pool, from, to int) {
	tb.Helper()
	for _, mig := range migrate.Migrations()[from-1 : to] {
		if _, err := pool.Exec(context.Background(), mig.Up); err != nil {
			fatalf(tb, "apply migration %03d_%s: %v", mig.Version, mig.Name, err)
		}
	}
}
