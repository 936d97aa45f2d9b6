package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/shard"
)

var (
	builtOnce sync.Once
	builtBin  string
	builtErr  error
)

// idemBinary builds the idem binary once for the test binary's life.
func idemBinary(t *testing.T) string {
	t.Helper()
	builtOnce.Do(func() {
		dir, err := os.MkdirTemp("", "idem-bin-")
		if err != nil {
			builtErr = err
			return
		}
		builtBin = filepath.Join(dir, "idem")
		out, err := exec.Command("go", "build", "-o", builtBin, ".").CombinedOutput()
		if err != nil {
			builtErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	require.NoError(t, builtErr)
	return builtBin
}

// binResult is one run of the built binary.
type binResult struct {
	code           int
	stdout, stderr string
}

func runBin(t *testing.T, args ...string) binResult {
	t.Helper()
	cmd := exec.Command(idemBinary(t), args...)
	// The shard map alone names the databases: no DATABASE_URL to fall back on.
	cmd.Env = append(os.Environ(), "DATABASE_URL=", "IDEM_SHARDS=")
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else {
		require.NoError(t, err)
	}
	return binResult{code: code, stdout: out.String(), stderr: errOut.String()}
}

// TestShardsCLI drives the built idem binary against the 3 shard clusters, with
// the map from --shard flags and from a --shards file: migrate up applies to every
// shard (and again applies nothing), stats sums the shards and lists each, inbox
// list pages across them with the merged cursor, inspect finds a key on its
// shard, failures lists groups of every shard, gc cleans every shard; a shard
// that is down is named (exit 3, partial stats); --shard beside --database-url is
// bad usage.
func TestShardsCLI(t *testing.T) {
	t.Parallel()
	m := pgtest.Shards(t, pgtest.Options{NoMigrate: true})
	urls := pgtest.ShardURLs(t)
	schema := m.Shards[0].Schema
	var flags []string
	file := shardsFile{}
	for i, s := range m.Shards {
		flags = append(flags, "--shard", fmt.Sprintf("%s=%s,schema=%s", s.Name, urls[i], schema))
		file.Shards = append(file.Shards, shardSpec{Name: s.Name, URL: urls[i], Schema: schema})
	}
	path := filepath.Join(t.TempDir(), "shards.json")
	b, err := json.Marshal(file)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(path, b, 0o600))
	withFile := func(args ...string) []string { return append(args, "--shards", path) }
	withFlags := func(args ...string) []string { return append(args, flags...) }

	r := runBin(t, withFlags("migrate", "up")...)
	require.Equal(t, 0, r.code, r.stderr)
	require.Contains(t, r.stdout, "applied 006_failure_groups to shards s1, s2, s3")
	for _, s := range m.Shards {
		require.Equal(t, 1, pgtest.Count(t, s.Pool, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'inbox'`, schema), s.Name)
	}
	r = runBin(t, withFile("migrate", "up")...)
	require.Equal(t, 0, r.code, r.stderr)
	require.Contains(t, r.stdout, "shards s1, s2, s3 are up to date")
	r = runBin(t, withFile("migrate", "list", "--json")...)
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, 3, strings.Count(r.stdout, `"shard"`))

	// Rows on every shard: 5 keys of each of 6 tenants, 2 of them failed, and 1
	// expired key each for gc.
	ctx := context.Background()
	var tenants []string
	per := map[string]int{}
	for i := 0; len(tenants) < 6; i++ {
		tenant := fmt.Sprintf("c%d", i)
		s, _ := m.Pick(tenant)
		if per[s.Name] == 2 {
			continue
		}
		per[s.Name]++
		tenants = append(tenants, tenant)
		_, err := s.Pool.Exec(ctx, `INSERT INTO inbox (consumer, tenant, key, fingerprint, state, expires_at, completed_at, error_code, error)
			SELECT 'orders', $1, 'k' || g, '\x00', CASE WHEN g <= 2 THEN 'failed' ELSE 'completed' END,
				now() + interval '1 day', now(), CASE WHEN g <= 2 THEN 'handler' END, CASE WHEN g <= 2 THEN 'bad order ' || g END
			FROM generate_series(1, 5) g`, tenant)
		require.NoError(t, err)
		_, err = s.Pool.Exec(ctx, `INSERT INTO inbox (consumer, tenant, key, fingerprint, state, expires_at, completed_at)
			VALUES ('orders', $1, 'old', '\x00', 'completed', now() - interval '1 hour', now() - interval '2 days')`, tenant)
		require.NoError(t, err)
	}

	r = runBin(t, withFile("stats", "--json")...)
	require.Equal(t, 0, r.code, r.stderr)
	var st admin.Stats
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &st))
	require.Len(t, st.Shards, 3)
	require.Equal(t, int64(36), st.Consumers[0].Rows)
	require.Equal(t, int64(12), st.Consumers[0].Failed)
	r = runBin(t, withFlags("stats")...)
	require.Equal(t, 0, r.code, r.stderr)
	require.Regexp(t, `s2\s+`+schema+`\s+up\s+12\s+4`, r.stdout)

	// inbox list, 4 at a time, through the merged cursor: every key once.
	seen := map[string]bool{}
	after := ""
	for pages := 0; ; pages++ {
		require.Less(t, pages, 20)
		args := withFlags("inbox", "list", "--limit", "4", "--json")
		if after != "" {
			args = append(args, "--after", after)
		}
		r = runBin(t, args...)
		require.Equal(t, 0, r.code, r.stderr)
		var keys []admin.InboxKey
		require.NoError(t, json.Unmarshal([]byte(r.stdout), &keys))
		for _, k := range keys {
			id := k.Shard + "/" + k.Tenant + "/" + k.Key
			require.False(t, seen[id], "%s twice", id)
			seen[id] = true
		}
		if r.stderr == "" {
			break
		}
		var next struct {
			NextAfter string `json:"next_after"`
		}
		require.NoError(t, json.Unmarshal([]byte(r.stderr), &next))
		after = next.NextAfter
	}
	require.Len(t, seen, 36)
	r = runBin(t, withFlags("inbox", "list", "--limit", "2")...)
	require.Equal(t, 0, r.code, r.stderr)
	require.Regexp(t, `^SHARD\s+CONSUMER\s+TENANT`, r.stdout)
	require.Regexp(t, `\ns[123]\s+orders\s+`, r.stdout)

	want, _ := m.Pick(tenants[3])
	r = runBin(t, withFile("inspect", "--consumer", "orders", "--tenant", tenants[3], "--key", "k4", "--json")...)
	require.Equal(t, 0, r.code, r.stderr)
	require.Contains(t, r.stdout, `"shard": "`+want.Name+`"`)

	r = runBin(t, withFile("failures", "--json")...)
	require.Equal(t, 0, r.code, r.stderr)
	var groups []admin.FailureGroup
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &groups))
	require.Len(t, groups, 6, "one group per tenant")
	shards := map[string]bool{}
	for _, g := range groups {
		shards[g.Shard] = true
	}
	require.Len(t, shards, 3)

	// tenants[0]'s group on another shard too (as after a move): one row, its
	// parts summed, naming both shards; show lists each part.
	home, _ := m.Pick(tenants[0])
	other := m.Shards[0]
	if other.Name == home.Name {
		other = m.Shards[1]
	}
	_, err = other.Pool.Exec(ctx, `INSERT INTO inbox (consumer, tenant, key, fingerprint, state, expires_at, completed_at, error_code, error)
		SELECT 'orders', $1, 'moved' || g, '\x00', 'failed', now() + interval '1 day', now() - interval '1 hour', 'handler', 'bad order ' || g
		FROM generate_series(1, 3) g`, tenants[0])
	require.NoError(t, err)
	both := strings.Join(slices.DeleteFunc(m.Names(), func(n string) bool { return n != home.Name && n != other.Name }), ",")
	r = runBin(t, withFile("failures", "--json")...)
	require.Equal(t, 0, r.code, r.stderr)
	groups = nil
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &groups))
	require.Len(t, groups, 6, "still one group per tenant")
	require.Equal(t, tenants[0], groups[0].Tenant, "the largest group, by its sum")
	require.Equal(t, int64(5), groups[0].Count, "2 failures on its shard and 3 on the other")
	require.Equal(t, both, groups[0].Shard)
	require.Len(t, groups[0].Parts, 2)
	r = runBin(t, withFlags("failures", "--limit", "1")...)
	require.Equal(t, 0, r.code, r.stderr)
	require.Regexp(t, `(?m)^SHARD\s+ID\s+SOURCE`, r.stdout)
	require.Regexp(t, `(?m)^`+both+`\s+`+groups[0].ID+`\s+inbox\s+orders\s+`+tenants[0]+`\s+handler\s+5\s`, r.stdout)
	r = runBin(t, withFlags("failures", "show", groups[0].ID)...)
	require.Equal(t, 0, r.code, r.stderr)
	require.Regexp(t, `Count\s+5\n`, r.stdout)
	require.Regexp(t, `(?m)^\s+`+home.Name+`\s+2\s`, r.stdout)
	require.Regexp(t, `(?m)^\s+`+other.Name+`\s+3\s`, r.stdout)

	r = runBin(t, withFlags("gc", "--json")...)
	require.Equal(t, 0, r.code, r.stderr)
	var gc gcJSON
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &gc))
	require.EqualValues(t, 6, gc.InboxDeleted)
	require.Equal(t, []string{"s1", "s2", "s3"}, gc.Shards)

	// A fourth shard nobody listens on: stats names it (exit 3) and shows the
	// others; a list refuses to show a page without it.
	down := []string{"--shard", "s4=postgres://postgres@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=2,schema=" + schema}
	r = runBin(t, append(withFlags("stats", "--json"), down...)...)
	require.Equal(t, exitNoPostgres, r.code, r.stderr)
	require.Contains(t, r.stderr, `"code":"shard_unavailable"`)
	require.Contains(t, r.stderr, `shard \"s4\"`)
	st = admin.Stats{}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &st))
	require.Equal(t, int64(33), st.Consumers[0].Rows, "the 3 shards that answered, after gc (with the 3 failures moved)")
	require.False(t, st.Shards[3].Up())
	r = runBin(t, append(withFlags("inbox", "list", "--json"), down...)...)
	require.Equal(t, exitNoPostgres, r.code, r.stderr)
	require.Empty(t, r.stdout)

	// Bad usage.
	r = runBin(t, append(withFlags("stats"), "--database-url", urls[0])...)
	require.Equal(t, exitUsage, r.code)
	require.Contains(t, r.stderr, "--database-url and --schema name one database")
	r = runBin(t, withFile(withFlags("stats")...)...)
	require.Equal(t, exitUsage, r.code)
	r = runBin(t, withFlags("migrate", "down", "--yes")...)
	require.Equal(t, exitUsage, r.code)
	r = runBin(t, "stats", "--shard", "s1")
	require.Equal(t, exitUsage, r.code)
	require.Contains(t, r.stderr, "use name=URL")
}

// TestShardsCLIMoveTenant: idem shard move-tenant, built, on the 3 shard
// clusters: the dry run's plan changes nothing, the move copies the tenant's keys
// and effects, hands its pending effects over and leaves no row of the tenant on
// the old shard, a second run copies nothing, and with the route switched in the
// shards file inspect reads the key on the new shard and idem effects requeue of
// one dead key requeues 1. A dead row left on a shard the route does not name
// makes the requeue exit with off_route, changing nothing.
func TestShardsCLIMoveTenant(t *testing.T) {
	t.Parallel()
	m := pgtest.Shards(t)
	urls := pgtest.ShardURLs(t)
	ctx := context.Background()
	old, err := m.Pick("acme")
	require.NoError(t, err)
	to := m.Shards[0]
	if to.Name == old.Name {
		to = m.Shards[1]
	}
	_, err = old.Pool.Exec(ctx, `INSERT INTO inbox (consumer, tenant, key, fingerprint, state, expires_at, completed_at)
		SELECT 'orders', 'acme', 'k' || g, '\x00', 'completed', now() + interval '1 day', now() FROM generate_series(1, 3) g`)
	require.NoError(t, err)
	_, err = old.Pool.Exec(ctx, `INSERT INTO effects (tenant, kind, key, fingerprint) VALUES ('acme', 'email', 'e1', '\x00'), ('acme', 'email', 'e2', '\x00')`)
	require.NoError(t, err)
	deadHook := `INSERT INTO effects (tenant, kind, key, fingerprint, state, attempts, last_error, error_code, dead_at)
		VALUES ('acme', 'webhook', $1, '\x00', 'dead', 3, 'refused', 'provider', now())`
	_, err = old.Pool.Exec(ctx, deadHook, "K")
	require.NoError(t, err)
	file := shardsFile{}
	for i, s := range m.Shards {
		file.Shards = append(file.Shards, shardSpec{Name: s.Name, URL: urls[i], Schema: s.Schema})
	}
	path := filepath.Join(t.TempDir(), "shards.json")
	write := func() {
		b, err := json.Marshal(file)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(path, b, 0o600))
	}
	write()

	r := runBin(t, "shard", "move-tenant", "--shards", path, "--tenant", "acme", "--to", to.Name, "--dry-run", "--json")
	require.Equal(t, 0, r.code, r.stderr)
	var res admin.MoveResult
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &res))
	require.Equal(t, admin.MoveResult{Tenant: "acme", From: old.Name, To: to.Name, DryRun: true,
		InboxKeys: map[string]int64{"completed": 3}, Effects: map[string]int64{"pending": 2, "dead": 1}}, res)
	require.Zero(t, pgtest.ShardCount(t, to, `SELECT count(*) FROM inbox`))

	r = runBin(t, "shard", "move-tenant", "--shards", path, "--tenant", "acme", "--to", to.Name)
	require.Equal(t, 0, r.code, r.stderr)
	require.Contains(t, r.stdout, "copied 3 inbox keys and 3 effects (rows already there kept), handed over 2 pending effects, deleted 3 inbox keys and 3 effects from "+old.Name)
	require.Equal(t, 3, pgtest.ShardCount(t, to, `SELECT count(*) FROM inbox WHERE tenant = 'acme'`))
	require.Equal(t, 2, pgtest.ShardCount(t, to, `SELECT count(*) FROM effects WHERE state = 'pending' AND next_attempt_at <= now()`))
	require.Equal(t, 1, pgtest.ShardCount(t, to, `SELECT count(*) FROM effects WHERE state = 'dead'`))
	require.Zero(t, pgtest.ShardCount(t, old, `SELECT count(*) FROM effects`))
	require.Zero(t, pgtest.ShardCount(t, old, `SELECT count(*) FROM inbox`))
	r = runBin(t, "shard", "move-tenant", "--shards", path, "--tenant", "acme", "--from", old.Name, "--to", to.Name, "--json")
	require.Equal(t, 0, r.code, r.stderr)
	res = admin.MoveResult{}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &res))
	require.Zero(t, res.InboxCopied+res.EffectsCopied+res.HandedOver)

	file.Table = map[string]string{"acme": to.Name}
	write()
	r = runBin(t, "inspect", "--shards", path, "--consumer", "orders", "--tenant", "acme", "--key", "k2", "--json")
	require.Equal(t, 0, r.code, r.stderr)
	require.Contains(t, r.stdout, `"shard": "`+to.Name+`"`)
	r = runBin(t, "effects", "requeue", "--shards", path, "--kind", "webhook", "--tenant", "acme", "--key", "K", "--json")
	require.Equal(t, 0, r.code, r.stderr)
	require.Contains(t, r.stdout, `"requeued": 1`)
	require.Equal(t, 1, pgtest.ShardCount(t, to, `SELECT count(*) FROM effects WHERE key = 'K' AND state = 'pending'`))

	// A dead copy on the old shard (a move not finished): refused, nothing changed.
	for _, s := range []shard.Shard{old, to} {
		_, err = s.Pool.Exec(ctx, deadHook, "K2")
		require.NoError(t, err)
	}
	r = runBin(t, "effects", "requeue", "--shards", path, "--kind", "webhook", "--tenant", "acme", "--key", "K2", "--json")
	require.NotEqual(t, 0, r.code)
	require.Contains(t, r.stderr, `"code":"off_route"`)
	require.Contains(t, r.stderr, "--from "+old.Name+" --to "+to.Name)
	for _, s := range []shard.Shard{old, to} {
		require.Equal(t, 1, pgtest.ShardCount(t, s, `SELECT count(*) FROM effects WHERE key = 'K2' AND state = 'dead'`), s.Name)
	}
	r = runBin(t, "shard", "move-tenant", "--tenant", "acme", "--to", to.Name, "--database-url", urls[0])
	require.Equal(t, exitUsage, r.code)
}

// TestShardsConsoleOffRoute: the console over a shard map answers a requeue of a
// dead effect that is also on a shard its tenant's route does not name (a move not
// finished) with 409 off_route, and changes neither shard.
func TestShardsConsoleOffRoute(t *testing.T) {
	t.Parallel()
	m := pgtest.Shards(t)
	ctx := context.Background()
	routed, err := m.Pick("acme")
	require.NoError(t, err)
	other := m.Shards[0]
	if other.Name == routed.Name {
		other = m.Shards[1]
	}
	for _, s := range []shard.Shard{routed, other} {
		_, err := s.Pool.Exec(ctx, `INSERT INTO effects (tenant, kind, key, fingerprint, state, attempts, last_error)
			VALUES ('acme', 'email', 'receipt:1', '\x00', 'dead', 25, 'boom')`)
		require.NoError(t, err)
	}
	a, err := admin.New(admin.Config{Shards: m})
	require.NoError(t, err)
	srv := httptest.NewUnstartedServer(nil)
	h, err := newConsole(a, consoleConfig{Hosts: consoleHosts(srv.Listener.Addr(), "127.0.0.1")})
	require.NoError(t, err)
	srv.Config.Handler = h
	srv.Start()
	t.Cleanup(srv.Close)
	var session sessionJSON
	require.NoError(t, json.Unmarshal(call(t, srv, "GET", "/api/session", "", nil).body, &session))
	r := call(t, srv, "POST", "/api/requeue", `{"tenant": "acme", "kind": "email", "key": "receipt:1"}`,
		map[string]string{"Content-Type": "application/json", tokenHeader: session.Token, "Sec-Fetch-Site": "same-origin"})
	require.Equal(t, http.StatusConflict, r.status, "%s", r.body)
	require.Equal(t, "off_route", r.code(t))
	for _, s := range []shard.Shard{routed, other} {
		require.Equal(t, 1, pgtest.ShardCount(t, s, `SELECT count(*) FROM effects WHERE state = 'dead'`), s.Name)
	}
}
