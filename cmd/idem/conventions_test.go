package main

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/spf13/pflag"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
)

func TestParseDuration(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]time.Duration{
		"7d": 7 * 24 * time.Hour, "1d12h": 36 * time.Hour, "1.5d": 36 * time.Hour, "0.5d": 12 * time.Hour,
		"90m": 90 * time.Minute, "5ms": 5 * time.Millisecond, "0s": 0, "0": 0, "-1d": -24 * time.Hour,
		"2d30m15s": 48*time.Hour + 30*time.Minute + 15*time.Second, "+3h": 3 * time.Hour,
	} {
		got, err := parseDuration(in)
		require.NoError(t, err, in)
		require.Equal(t, want, got, in)
		back, err := parseDuration(formatDuration(got))
		require.NoError(t, err, in)
		require.Equal(t, got, back, "formatDuration(%s) = %s reads back", in, formatDuration(got))
	}
	for _, in := range []string{"", "d", "7", "7x", "d7", "1d-2h", "1dd", "7 d", "999999999d", "1.2.3d", "-"} {
		_, err := parseDuration(in)
		require.ErrorIs(t, err, errBadDuration, "%q", in)
	}
	require.Equal(t, "7d", formatDuration(7*24*time.Hour))
	require.Equal(t, "1d12h0m0s", formatDuration(36*time.Hour))
	require.Equal(t, "5ms", formatDuration(5*time.Millisecond))
}

// Every duration flag takes days: gc's retention, in the same run as its help.
func TestDurationFlagsTakeDays(t *testing.T) {
	b := setup(t)
	_, err := b.pool.Exec(context.Background(), `INSERT INTO effects (kind, key, fingerprint, state, done_at) VALUES
		('email', 'old', '\x00', 'done', now() - interval '49 hours'),
		('email', 'new', '\x00', 'done', now() - interval '47 hours')`)
	require.NoError(t, err)
	var out gcJSON
	b.idem("gc", "--effects-retention", "2d", "--pause", "0d", "--json").ok(t).decode(t, &out)
	require.EqualValues(t, 1, out.EffectsDeleted)
	require.Contains(t, runCLI(t, "gc", "--help").ok(t).stdout, "--effects-retention duration")
	require.Contains(t, runCLI(t, "gc", "--help").ok(t).stdout, "(default 7d)")
	r := runCLI(t, "gc", "--pause", "7y")
	require.Equal(t, exitUsage, r.code)
	require.Contains(t, r.stderr, "such as 90s, 15m, 12h, 7d or 1d12h")
	require.Contains(t, runCLI(t, "bench", "--help").ok(t).stdout, "--max-wait duration")
}

// Global flags work before or after the command's name, with the same answer.
func TestGlobalFlagsBeforeOrAfter(t *testing.T) {
	b := setup(t)
	b.process("acme", "pay-1", `{}`)
	after := runCLI(t, "inspect", "--consumer", "payments", "--tenant", "acme", "--key", "pay-1", "--json", "--database-url", pgtest.URL(), "--schema", b.schema).ok(t)
	before := runCLI(t, "--json", "--database-url", pgtest.URL(), "--schema="+b.schema, "inspect", "--consumer", "payments", "--tenant", "acme", "--key", "pay-1").ok(t)
	require.Equal(t, after.stdout, before.stdout)
	require.Contains(t, runCLI(t, "--json", "--database-url="+pgtest.URL(), "--schema", b.schema, "stats").ok(t).stdout, `"schema": "`+b.schema+`"`)
	mixed := runCLI(t, "--json", "effects", "list", "--state", "pending", "--database-url", pgtest.URL(), "--schema", b.schema).ok(t)
	require.Contains(t, mixed.stdout, `"key": "receipt:acme:pay-1"`)
	r := runCLI(t, "--schema", b.schema, "--database-url", pgtest.URL(), "inspect", "--consumer", "payments", "--tenant", "acme", "--key", "pay-1").ok(t)
	require.Regexp(t, `state\s+completed`, r.stdout)

	r = runCLI(t, "--kind", "email", "effects", "list")
	require.Equal(t, exitUsage, r.code)
	require.Contains(t, r.stderr, "a command's own flags go after its name")
	r = runCLI(t, "--schema")
	require.Equal(t, exitUsage, r.code)
	require.Contains(t, r.stderr, "needs a value")
}

func decodeError(t *testing.T, stderr string) errorJSON {
	t.Helper()
	var e errorJSON
	require.NoError(t, json.Unmarshal([]byte(stderr), &e), "stderr is one JSON object: %s", stderr)
	require.NotEmpty(t, e.Code)
	require.NotEmpty(t, e.Message)
	return e
}

// With --json, every error is JSON on stderr with a stable code, wherever --json
// is and whatever failed.
func TestJSONErrors(t *testing.T) {
	b := setup(t)
	cases := []struct {
		args []string
		exit int
		code string
	}{
		{[]string{"--json", "frobnicate"}, exitUsage, "usage"},
		{[]string{"--json"}, exitUsage, "usage"},
		{[]string{"--json", "effects"}, exitUsage, "usage"},
		{[]string{"stats", "--no-such-flag", "--json"}, exitUsage, "usage"},
		{[]string{"--json", "stats", "--no-such-flag"}, exitUsage, "usage"},
		{[]string{"effects", "list", "--state", "weird", "--json"}, exitUsage, "usage"},
		{[]string{"effects", "list", "--after", "not-a-cursor", "--json", "--database-url", pgtest.URL(), "--schema", b.schema}, exitUsage, "usage"},
		{[]string{"stats", "--json", "--database-url", "postgres://postgres@127.0.0.1:1/postgres?connect_timeout=2"}, exitNoPostgres, "postgres_unreachable"},
		{[]string{"stats", "--json", "--database-url", "postgres://u:pw@host:notaport/db"}, exitUsage, "bad_database_url"},
		{[]string{"inspect", "--consumer", "c", "--key", "k", "--json", "--database-url", pgtest.URL(), "--schema", b.schema}, exitFailure, "not_found"},
		{[]string{"effects", "requeue", "--kind", "email", "--key", "k", "--json", "--database-url", pgtest.URL(), "--schema", b.schema}, exitFailure, "not_found"},
		{[]string{"stats", "--json", "--database-url", pgtest.URL(), "--schema", "t_no_such_schema"}, exitFailure, "schema_missing"},
	}
	for _, c := range cases {
		r := runCLI(t, c.args...)
		require.Equal(t, c.exit, r.code, "%q: %s", c.args, r.stderr)
		require.Empty(t, r.stdout, "%q", c.args)
		e := decodeError(t, r.stderr)
		require.Equal(t, c.code, e.Code, "%q: %s", c.args, r.stderr)
		require.Equal(t, c.exit, e.ExitCode)
		if c.code == "postgres_unreachable" || c.code == "schema_missing" {
			require.NotEmpty(t, e.Hint, "an error says what to do next")
		}
	}
	e := decodeError(t, runCLI(t, "stats", "--json", "--database-url", "postgres://u:pw@host:notaport/db").stderr)
	require.NotContains(t, e.Message+e.Hint, "pw@", "the password is masked in JSON errors too")
}

// One exit code for "cannot reach Postgres", for every command that connects,
// demo and bench included.
func TestExitCodeNoPostgres(t *testing.T) {
	t.Parallel()
	const dsn = "postgres://postgres:s3cret-x@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=2"
	for _, args := range [][]string{
		{"migrate", "list"},
		{"inspect", "--consumer", "c", "--key", "k"},
		{"find", "--key", "k"},
		{"inbox", "list"},
		{"stats"},
		{"gc"},
		{"effects", "list"},
		{"effects", "requeue", "--kind", "email", "--all-dead"},
		{"forget", "--consumer", "c", "--key", "k", "--reason", "r", "--yes"},
		{"console", "--addr", "127.0.0.1:0"},
		{"bench", "-n", "10"},
		{"demo", "-n", "10"},
	} {
		r := runCLI(t, append(args, "--database-url", dsn)...)
		require.Equal(t, exitNoPostgres, r.code, "%q: %s", args, r.stderr)
		require.Contains(t, r.stderr, "cannot connect to Postgres at 127.0.0.1:1", "%q", args)
		require.NotContains(t, r.stderr, "s3cret-x")
	}
	require.Contains(t, runCLI(t, "--help").ok(t).stdout, "3  cannot connect to Postgres")
}

// Without --database-url and DATABASE_URL, the PG* variables name the server, as
// for psql; IDEM_SCHEMA names the schema. (Not parallel: it sets the environment.)
func TestPGEnvironmentAndIdemSchema(t *testing.T) {
	pgtest.Require(t)
	cfg, err := pgconn.ParseConfig(pgtest.URL())
	require.NoError(t, err)
	b := &bundle{t: t}
	b.pool, b.schema = pgtest.Setup(t, pgtest.Options{MaxConns: 2})
	b.process("acme", "pay-1", `{}`)

	t.Setenv("DATABASE_URL", "")
	for _, v := range pgTargetVars {
		t.Setenv(v, "")
	}
	t.Setenv("PGHOST", cfg.Host)
	t.Setenv("PGPORT", strconv.Itoa(int(cfg.Port)))
	t.Setenv("PGUSER", cfg.User)
	t.Setenv("PGDATABASE", cfg.Database)
	t.Setenv("PGSSLMODE", "disable")
	if cfg.Password != "" {
		t.Setenv("PGPASSWORD", cfg.Password)
	}
	t.Setenv("IDEM_SCHEMA", b.schema)
	var s struct {
		Schema    string `json:"schema"`
		Consumers []struct{ Consumer string }
	}
	runCLI(t, "stats", "--json").ok(t).decode(t, &s)
	require.Equal(t, b.schema, s.Schema, "IDEM_SCHEMA")
	require.Len(t, s.Consumers, 1)
	require.Contains(t, runCLI(t, "stats", "--help").ok(t).stdout, "$IDEM_SCHEMA, else idem")

	// --schema beats IDEM_SCHEMA; DATABASE_URL beats the PG* variables.
	r := runCLI(t, "stats", "--schema", "t_not_there")
	require.Equal(t, exitFailure, r.code)
	require.Contains(t, r.stderr, "idem migrate up --schema t_not_there")
	t.Setenv("DATABASE_URL", "postgres://postgres@127.0.0.1:1/postgres?connect_timeout=2")
	require.Equal(t, exitNoPostgres, runCLI(t, "stats").code)
	t.Setenv("DATABASE_URL", "")

	// A PG* server that does not answer is exit 3; PGPASSWORD is never printed.
	t.Setenv("PGPORT", "1")
	t.Setenv("PGCONNECT_TIMEOUT", "2")
	t.Setenv("PGPASSWORD", "pg-env-s3cret")
	r = runCLI(t, "stats")
	require.Equal(t, exitNoPostgres, r.code, r.stderr)
	require.Contains(t, r.stderr, ":1")
	require.NotContains(t, r.stderr, "pg-env-s3cret")

	// The demo never takes IDEM_SCHEMA as its scratch schema (it names a real
	// deployment's schema): only an explicit --schema.
	t.Setenv("PGPORT", strconv.Itoa(int(cfg.Port)))
	t.Setenv("PGPASSWORD", cfg.Password)
	e := &env{}
	fs := pflag.NewFlagSet("demo", pflag.ContinueOnError)
	e.globalFlags(fs)
	require.NoError(t, fs.Parse(nil))
	e.resolve(fs)
	require.Equal(t, b.schema, e.schema)
	require.False(t, e.schemaGiven)
}

func TestVersion(t *testing.T) {
	t.Parallel()
	var v versionJSON
	runCLI(t, "version", "--json").ok(t).decode(t, &v)
	require.NotEmpty(t, v.Go)
	require.True(t, strings.HasPrefix(v.Go, "go"), v.Go)
	require.NotEmpty(t, v.Version)
	require.Equal(t, runCLI(t, "version").ok(t).stdout, runCLI(t, "--version").ok(t).stdout)
	require.Contains(t, runCLI(t, "--json", "version").ok(t).stdout, `"go": "go`)

	// The VCS stamp, as the build info carries it.
	v = versionOf(&debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Path: "github.com/idemkit/idem/cmd/idem", Version: "v1.2.3"},
		Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "abc123"}, {Key: "vcs.time", Value: "2026-11-21T23:02:11Z"}, {Key: "vcs.modified", Value: "true"}}})
	require.Equal(t, versionJSON{Module: "github.com/idemkit/idem/cmd/idem", Version: "v1.2.3", Revision: "abc123", Time: "2026-11-21T23:02:11Z", Modified: true, Go: "go1.26.8"}, v)

	// A real binary, built with VCS stamping, reports the commit it was built
	// from. The go command stamps only a checkout whose .git is a directory: a
	// git worktree (.git is a file) is built without a stamp, and says so.
	git, err := exec.LookPath("git")
	require.NoError(t, err, "git is needed to check the VCS stamp")
	head, err := exec.Command(git, "rev-parse", "HEAD").Output()
	require.NoError(t, err)
	bin := filepath.Join(t.TempDir(), "idem")
	build := exec.Command("go", "build", "-o", bin, ".")
	build.Env = append(os.Environ(), "GOFLAGS=-buildvcs=auto")
	out, err := build.CombinedOutput()
	require.NoError(t, err, "%s", out)
	got, err := exec.Command(bin, "version", "--json").Output()
	require.NoError(t, err)
	v = versionJSON{}
	require.NoError(t, json.Unmarshal(got, &v))
	require.Equal(t, "github.com/idemkit/idem/cmd/idem", v.Module)
	top, err := exec.Command(git, "rev-parse", "--show-toplevel").Output()
	require.NoError(t, err)
	if fi, err := os.Stat(filepath.Join(strings.TrimSpace(string(top)), ".git")); err == nil && !fi.IsDir() {
		t.Logf("checked the version without a VCS stamp: %s is a git worktree, which the go command does not stamp", strings.TrimSpace(string(top)))
		require.Empty(t, v.Revision)
		text, err := exec.Command(bin, "version").Output()
		require.NoError(t, err)
		require.NotContains(t, string(text), "revision")
		return
	}
	require.Equal(t, strings.TrimSpace(string(head)), v.Revision)
	require.NotEmpty(t, v.Time)
	text, err := exec.Command(bin, "version").Output()
	require.NoError(t, err)
	require.Contains(t, string(text), strings.TrimSpace(string(head)))
}
