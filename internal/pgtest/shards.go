package pgtest

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redact"
	"github.com/idemkit/idem/migrate"
	"github.com/idemkit/idem/shard"
)

// ShardURLsVar names the environment variable with the shard clusters' URLs,
// comma-separated, as scripts/services start shards prints it.
const ShardURLsVar = "IDEM_SHARD_URLS"

// HowToStartShards says how to bring up the shard clusters.
const HowToStartShards = `start them with:
    eval "$(scripts/services start shards)"
(three small Postgres clusters on 127.0.0.1:5441..5443, which export ` + ShardURLsVar + `)`

// ShardURLs returns the shard clusters' URLs, failing the test with instructions
// when the variable is unset or names fewer than two.
func ShardURLs(tb testing.TB) []string {
	tb.Helper()
	var urls []string
	for _, u := range strings.Split(os.Getenv(ShardURLsVar), ",") {
		if u = strings.TrimSpace(u); u != "" {
			urls = append(urls, u)
		}
	}
	if len(urls) < 2 {
		tb.Fatalf("%s names %d shard clusters; the shard tests need three\n%s", ShardURLsVar, len(urls), HowToStartShards)
	}
	return urls
}

// Shards returns a shard map over the shard clusters (names s1, s2, ...), each with
// a fresh migrated schema of its own dropped when the test ends. It holds a shared
// lock on the clusters for the test's life, so a test that crashes a cluster
// (CrashableShards) never runs beside it.
func Shards(tb testing.TB, opts ...Options) *shard.Map {
	tb.Helper()
	lockFile(tb, shardLock, syscall.LOCK_SH)
	return shardMap(tb, ShardURLs(tb), opts)
}

// ShardsAt is Shards over the clusters of urls (names s1, s2, ... in that order):
// the shard clusters' and a test's own (OwnCluster), say.
func ShardsAt(tb testing.TB, urls []string, opts ...Options) *shard.Map {
	tb.Helper()
	lockFile(tb, shardLock, syscall.LOCK_SH)
	return shardMap(tb, urls, opts)
}

// OwnCluster is a Postgres cluster of one test's own, which it may crash while
// other tests, of every package and every person on the machine, use the shard
// clusters: scripts/services starts it as it starts a shard cluster, under a
// fresh state directory (IDEM_SHARDS_DIR) and on a free port
// (IDEM_SHARD_BASE_PORT), so its crash and start touch that cluster alone.
type OwnCluster struct {
	tb  testing.TB
	env []string
	// URL is the cluster's, user postgres, database postgres.
	URL string
}

// StartOwnCluster starts a cluster of the test's own; when the test ends it is
// stopped and its directory removed.
func StartOwnCluster(tb testing.TB) *OwnCluster {
	tb.Helper()
	dir, err := os.MkdirTemp("", "idem-own-cluster-")
	if err != nil {
		tb.Fatal(err)
	}
	c := &OwnCluster{tb: tb}
	tb.Cleanup(func() {
		if c.env != nil {
			if err := c.services("stop"); err != nil {
				tb.Error(err)
			}
		}
		_ = os.RemoveAll(dir)
	})
	// A port free now may be taken before the cluster listens: then another.
	for try := 1; ; try++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			tb.Fatal(err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		_ = l.Close()
		c.URL = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", port)
		c.env = append(os.Environ(), "IDEM_SHARDS_DIR="+dir, fmt.Sprintf("IDEM_SHARD_BASE_PORT=%d", port-1))
		err = c.services("start")
		if err == nil {
			return c
		}
		if try == 3 {
			tb.Fatal(err)
		}
		tb.Logf("own cluster, try %d: %v", try, err)
	}
}

// Crash stops the cluster with pg_ctl stop -m immediate, as a server crash.
func (c *OwnCluster) Crash() {
	c.tb.Helper()
	if err := c.services("crash"); err != nil {
		c.tb.Fatal(err)
	}
}

// Start starts the cluster again and waits until it answers.
func (c *OwnCluster) Start() {
	c.tb.Helper()
	if err := c.services("start"); err != nil {
		c.tb.Fatal(err)
	}
}

func (c *OwnCluster) services(cmd string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	run := exec.CommandContext(ctx, filepath.Join(moduleRoot(), "scripts", "services"), cmd, "shard1")
	run.Env = c.env
	if out, err := run.CombinedOutput(); err != nil {
		return fmt.Errorf("scripts/services %s shard1 (a test's own cluster): %v\n%s", cmd, err, out)
	}
	return nil
}

// ShardCtl stops and starts the shard clusters of a CrashableShards test.
type ShardCtl struct {
	tb testing.TB
}

// CrashableShards is Shards for a test that stops clusters: it holds the lock on
// the clusters alone, so it waits for the other shard tests of every package and
// they wait for it. When the test ends every cluster is started again.
func CrashableShards(tb testing.TB, opts ...Options) (*shard.Map, *ShardCtl) {
	tb.Helper()
	lockFile(tb, shardLock, syscall.LOCK_EX)
	ctl := &ShardCtl{tb: tb}
	// Cleanups run last-in first-out: the clusters are up again before the
	// schemas are dropped and the lock is released.
	m := shardMap(tb, ShardURLs(tb), opts)
	tb.Cleanup(func() {
		for i := range m.Shards {
			ctl.start(i, false)
		}
	})
	return m, ctl
}

// Crash stops shard i (0-based, map order) with pg_ctl stop -m immediate, as a
// server crash, through scripts/services, which touches only the clusters it
// started for shards.
func (c *ShardCtl) Crash(i int) {
	c.tb.Helper()
	services(c.tb, "crash", shardName(i))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if pingURL(ctx, ShardURLs(c.tb)[i]) == nil {
		c.tb.Fatalf("shard %d still answers after scripts/services crash shard%d; the crash tests need the clusters that scripts/services start shards started", i+1, i+1)
	}
}

// Start starts shard i again and waits until it answers.
func (c *ShardCtl) Start(i int) {
	c.tb.Helper()
	c.start(i, true)
}

func (c *ShardCtl) start(i int, fatal bool) {
	c.tb.Helper()
	if err := servicesErr("start", shardName(i)); err != nil {
		if fatal {
			c.tb.Fatal(err)
		}
		c.tb.Error(err)
	}
}

// shardName is scripts/services' name of shard i (0-based).
func shardName(i int) string { return fmt.Sprintf("shard%d", i+1) }

// services runs scripts/services cmd service, failing the test if it fails.
func services(tb testing.TB, cmd, service string) {
	tb.Helper()
	if err := servicesErr(cmd, service); err != nil {
		tb.Fatal(err)
	}
}

// servicesErr runs scripts/services cmd service and returns its output with its
// error.
func servicesErr(cmd, service string) error {
	script := filepath.Join(moduleRoot(), "scripts", "services")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, script, cmd, service).CombinedOutput()
	if err != nil {
		return fmt.Errorf("scripts/services %s %s: %v\n%s", cmd, service, err, out)
	}
	return nil
}

// moduleRoot is the directory of idem's go.mod, above the test's directory.
func moduleRoot() string {
	dir, _ := os.Getwd()
	for d := dir; ; d = filepath.Dir(d) {
		if b, err := os.ReadFile(filepath.Join(d, "go.mod")); err == nil && bytes.HasPrefix(b, []byte("module github.com/idemkit/idem\n")) {
			return d
		}
		if filepath.Dir(d) == d {
			return dir
		}
	}
}

// shardLock is the lock file of the shard clusters (see lockFile).
const shardLock = "idem-shard-clusters.lock"

// lockFile takes a file lock, shared or exclusive, for the test's life. The file,
// name in the temporary directory, is the same for every package's tests on the
// machine.
func lockFile(tb testing.TB, name string, how int) {
	tb.Helper()
	f, err := os.OpenFile(filepath.Join(os.TempDir(), name), os.O_CREATE|os.O_RDWR, 0o666)
	if err != nil {
		tb.Fatalf("lock %s: %v", name, err)
	}
	if err := syscall.Flock(int(f.Fd()), how); err != nil {
		_ = f.Close()
		tb.Fatalf("lock %s: %v", name, err)
	}
	tb.Cleanup(func() { _ = f.Close() }) // closing the file releases the lock
}

func shardMap(tb testing.TB, urls []string, opts []Options) *shard.Map {
	tb.Helper()
	var o Options
	if len(opts) > 0 {
		o = opts[0]
	}
	schema := NewSchemaName()
	m := &shard.Map{}
	for i, url := range urls {
		cfg, err := configAt(url, schema, o, 6)
		if err != nil {
			tb.Fatalf("parse %s: %v", ShardURLsVar, err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err = pingURL(ctx, url)
		cancel()
		if err != nil {
			tb.Fatal(redact.Text(fmt.Sprintf("shard cluster %s is not reachable: %v\n%s", url, err, HowToStartShards), url))
		}
		pool := OpenPool(tb, cfg)
		m.Shards = append(m.Shards, shard.Shard{Name: fmt.Sprintf("s%d", i+1), Pool: pool, Schema: schema})
		tb.Cleanup(func() { dropOn(tb, url, schema) })
	}
	if !o.NoMigrate {
		mg, err := migrate.New(migrate.Config{Shards: m})
		if err != nil {
			tb.Fatal(err)
		}
		if _, err := mg.Up(context.Background()); err != nil {
			tb.Fatalf("migrate the shards: %v", err)
		}
	} else {
		for _, s := range m.Shards {
			if _, err := s.Pool.Exec(context.Background(), `CREATE SCHEMA `+schema); err != nil {
				tb.Fatalf("create schema on %s: %v", s.Name, err)
			}
		}
	}
	return m
}

// ShardCount counts rows on one shard.
func ShardCount(tb testing.TB, s shard.Shard, sql string, args ...any) int {
	tb.Helper()
	return Count(tb, s.Pool, sql, args...)
}
