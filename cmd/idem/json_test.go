package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
)

// buildIdem builds the idem binary into the test's temporary directory.
func buildIdem(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "idem")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	require.NoError(t, err, "%s", out)
	return bin
}

// unreachableDSN is a Postgres no test reaches: a case that connects by mistake
// (instead of failing on its arguments first) exits 3 and shows it.
const unreachableDSN = "postgres://postgres:s3cret-x@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=2"

// runBinary runs the built idem with args, DATABASE_URL set to dsn and no other
// Postgres variable, and returns its exit code and output.
func runBinary(t *testing.T, bin, dsn string, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "PG") && !strings.HasPrefix(kv, "DATABASE_URL=") && !strings.HasPrefix(kv, "IDEM_SCHEMA=") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, "DATABASE_URL="+dsn)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	code := 0
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		code = exit.ExitCode()
	} else {
		require.NoError(t, err)
	}
	return result{code: code, stdout: stdout.String(), stderr: stderr.String()}
}

// oneJSONObject decodes stderr, which must be exactly one JSON object on one
// line, and nothing else.
func oneJSONObject(t *testing.T, stderr string) (errorJSON, map[string]any) {
	t.Helper()
	require.True(t, strings.HasSuffix(stderr, "\n") && strings.Count(stderr, "\n") == 1, "one line on stderr: %q", stderr)
	dec := json.NewDecoder(strings.NewReader(stderr))
	var raw map[string]any
	require.NoError(t, dec.Decode(&raw), "stderr is a JSON object: %q", stderr)
	var rest any
	require.ErrorIs(t, dec.Decode(&rest), io.EOF, "nothing after the object: %q", stderr)
	var e errorJSON
	require.NoError(t, json.Unmarshal([]byte(stderr), &e))
	require.NotEmpty(t, e.Code, stderr)
	require.NotEmpty(t, e.Message, stderr)
	return e, raw
}

// With --json anywhere on the line, every error of the real binary, usage
// errors included, is exactly one JSON object on stderr, with a stable code and
// the exit code; stdout is empty. --help still prints help on stdout.
func TestJSONEverywhere(t *testing.T) {
	b := setup(t)
	b.process("acme", "pay-1", `{}`)
	b.process("acme", "pay-2", `{}`)
	bin := buildIdem(t)
	db := []string{"--database-url", pgtest.URL(), "--schema", b.schema}
	withDB := func(args ...string) []string { return append(args, db...) }

	cases := []struct {
		name string
		args []string
		exit int
		code string
	}{
		// Unknown commands and subcommands, --json before or after.
		{"unknown command, --json after", []string{"frobnicate", "--json"}, exitUsage, "usage"},
		{"unknown command, --json before", []string{"--json", "frobnicate"}, exitUsage, "usage"},
		{"unknown command, -json=1", []string{"-json=1", "frobnicate"}, exitUsage, "usage"},
		{"unknown subcommand", []string{"effects", "frobnicate", "--json"}, exitUsage, "usage"},
		{"missing subcommand", []string{"effects", "--json"}, exitUsage, "usage"},
		{"no command", []string{"--json"}, exitUsage, "usage"},
		{"help on an unknown command", []string{"help", "frobnicate", "--json"}, exitUsage, "usage"},
		// Unknown flags before and after the command.
		{"unknown flag before, --json first", []string{"--json", "--bogus", "stats"}, exitUsage, "usage"},
		{"unknown flag before, --json last", []string{"--bogus", "stats", "--json"}, exitUsage, "usage"},
		{"unknown flag after", []string{"stats", "--bogus", "--json"}, exitUsage, "usage"},
		{"unknown flag after, --json first", []string{"--json", "stats", "--bogus"}, exitUsage, "usage"},
		{"a command's flag before the command", []string{"--kind", "email", "effects", "list", "--json"}, exitUsage, "usage"},
		{"unknown flag of a subcommand", []string{"effects", "list", "--bogus", "--json"}, exitUsage, "usage"},
		{"a bad --json value", []string{"stats", "--json=maybe"}, exitUsage, "usage"},
		// Missing arguments and values.
		{"global flag without its value", []string{"--json", "--schema"}, exitUsage, "usage"},
		{"flag without its value", []string{"stats", "--json", "--schema"}, exitUsage, "usage"},
		{"--json taken as a value", []string{"stats", "--schema", "--json"}, exitUsage, "usage"},
		{"inspect without --key", []string{"inspect", "--consumer", "c", "--json"}, exitUsage, "usage"},
		{"requeue without --key", []string{"effects", "requeue", "--kind", "email", "--json"}, exitUsage, "usage"},
		{"forget without --reason", []string{"forget", "--consumer", "c", "--key", "k", "--json"}, exitUsage, "usage"},
		{"find without --key", []string{"find", "--json"}, exitUsage, "usage"},
		{"completion without a shell", []string{"completion", "--json"}, exitUsage, "usage"},
		{"completion of an unknown shell", []string{"completion", "tcsh", "--json"}, exitUsage, "usage"},
		// Each command's own bad usage.
		{"migrate, unknown action", []string{"migrate", "sideways", "--json"}, exitUsage, "usage"},
		{"migrate up --yes", []string{"migrate", "up", "--yes", "--json"}, exitUsage, "usage"},
		{"stats with an argument", []string{"stats", "extra", "--json"}, exitUsage, "usage"},
		{"bad schema name", []string{"stats", "--schema", "Bad-Schema", "--json"}, exitUsage, "usage"},
		{"gc, bad duration", []string{"gc", "--pause", "soon", "--json"}, exitUsage, "usage"},
		{"gc, bad batch size", []string{"gc", "--batch-size", "0", "--json"}, exitUsage, "usage"},
		{"effects list, bad state", []string{"effects", "list", "--state", "weird", "--json"}, exitUsage, "usage"},
		{"inbox list, bad time", []string{"inbox", "list", "--since", "yesterday", "--json"}, exitUsage, "usage"},
		{"console, not loopback", []string{"console", "--addr", "0.0.0.0:8080", "--json"}, exitUsage, "usage"},
		{"console, bad address", []string{"console", "--addr", "nonsense", "--json"}, exitUsage, "usage"},
		{"bench, bad -n", []string{"bench", "-n", "0", "--json"}, exitUsage, "usage"},
		{"demo, bad broker", []string{"demo", "--broker", "carrier-pigeon", "--json"}, exitUsage, "usage"},
		{"version with an argument", []string{"version", "now", "--json"}, exitUsage, "usage"},
		// Postgres: unreachable, a DSN that does not parse, no tables.
		{"stats, no Postgres", []string{"stats", "--json"}, exitNoPostgres, "postgres_unreachable"},
		{"migrate list, no Postgres", []string{"--json", "migrate", "list"}, exitNoPostgres, "postgres_unreachable"},
		{"console, no Postgres", []string{"console", "--addr", "127.0.0.1:0", "--json"}, exitNoPostgres, "postgres_unreachable"},
		{"bench, no Postgres", []string{"bench", "-n", "10", "--json"}, exitNoPostgres, "postgres_unreachable"},
		{"demo, no Postgres (it waits for one first)", []string{"demo", "-n", "10", "--json"}, exitNoPostgres, "postgres_unreachable"},
		{"bad DSN", []string{"stats", "--json", "--database-url", "postgres://u:pw@host:notaport/db"}, exitUsage, "bad_database_url"},
		{"no tables", []string{"stats", "--json", "--database-url", pgtest.URL(), "--schema", "t_no_such_schema"}, exitFailure, "schema_missing"},
		{"gc, no tables", []string{"gc", "--json", "--database-url", pgtest.URL(), "--schema", "t_no_such_schema"}, exitFailure, "schema_missing"},
		// Each command's failures on a real schema.
		{"inspect, no such key", withDB("inspect", "--consumer", "c", "--key", "k", "--json"), exitFailure, "not_found"},
		{"effect requeue, no such effect", withDB("effects", "requeue", "--kind", "email", "--key", "k", "--json"), exitFailure, "not_found"},
		{"effect requeue, not dead", withDB("effects", "requeue", "--kind", "email", "--tenant", "acme", "--key", "receipt:acme:pay-1", "--json"), exitFailure, "not_dead"},
		{"forget, no such key", withDB("forget", "--consumer", "c", "--key", "k", "--reason", "r", "--yes", "--json"), exitFailure, "not_found"},
		{"effects list, bad cursor", withDB("effects", "list", "--after", "not-a-cursor", "--json"), exitUsage, "usage"},
		{"inbox list, bad cursor", withDB("inbox", "list", "--after", "not-a-cursor", "--json"), exitUsage, "usage"},
		{"forget, not confirmed", withDB("forget", "--consumer", "payments", "--tenant", "acme", "--key", "pay-1", "--reason", "r", "--json"), exitUsage, "confirmation_required"},
		{"migrate down, not confirmed", withDB("migrate", "down", "--json"), exitUsage, "confirmation_required"},
	}
	var mu sync.Mutex
	plans := map[string]map[string]any{}
	t.Run("errors", func(t *testing.T) {
		for _, c := range cases {
			t.Run(c.name, func(t *testing.T) {
				t.Parallel()
				r := runBinary(t, bin, unreachableDSN, c.args...)
				require.Equal(t, c.exit, r.code, "idem %q\nstderr: %s", c.args, r.stderr)
				require.Empty(t, r.stdout, "idem %q", c.args)
				e, raw := oneJSONObject(t, r.stderr)
				require.Equal(t, c.code, e.Code, "idem %q: %s", c.args, r.stderr)
				require.Equal(t, c.exit, e.ExitCode, "idem %q", c.args)
				require.NotContains(t, r.stderr, "s3cret-x", "the password is never printed")
				if c.code == "confirmation_required" {
					plan, _ := raw["plan"].(map[string]any)
					mu.Lock()
					plans[c.args[0]] = plan
					mu.Unlock()
				}
			})
		}
	})

	// The refused dangerous commands carry what they would have done, and did
	// nothing.
	down := plans["migrate"]
	require.NotNil(t, down, "migrate down's error holds its plan")
	require.Equal(t, b.schema, down["schema"])
	require.NotEmpty(t, down["migration"])
	require.Contains(t, down, "dropped")
	forget := plans["forget"]
	require.NotNil(t, forget, "forget's error holds its plan")
	require.Equal(t, "pay-1", forget["key"])
	require.Equal(t, "completed", forget["state"])
	require.Equal(t, 1, pgtest.Count(t, b.pool, `SELECT count(*) FROM inbox WHERE key = 'pay-1'`), "nothing was forgotten")
	b.idem("migrate", "list", "--json").ok(t) // the tables are all there
	require.Equal(t, 1, pgtest.Count(t, b.pool, `SELECT count(*) FROM effects WHERE key = 'receipt:acme:pay-1'`))

	// --help is not an error: help on stdout, nothing on stderr, exit 0.
	for _, args := range [][]string{{"--json", "--help"}, {"stats", "--help", "--json"}, {"help", "stats", "--json"}, {"effects", "--help", "--json"}, {"--json", "effects", "list", "-h"}} {
		r := runBinary(t, bin, unreachableDSN, args...)
		require.Equal(t, exitOK, r.code, "idem %q: %s", args, r.stderr)
		require.NotEmpty(t, r.stdout, "idem %q", args)
		require.Empty(t, r.stderr, "idem %q", args)
	}

	// Success with --json: stdout is JSON, and stderr holds JSON only (here,
	// nothing; a list that goes on says where, as an object).
	r := runBinary(t, bin, pgtest.URL(), withDB("--json", "inbox", "list", "--limit", "1")...)
	require.Equal(t, exitOK, r.code, r.stderr)
	require.True(t, json.Valid([]byte(r.stdout)), r.stdout)
	var next struct {
		NextAfter string `json:"next_after"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.stderr), &next), r.stderr)
	require.NotEmpty(t, next.NextAfter)
	r = runBinary(t, bin, pgtest.URL(), withDB("gc", "--json")...)
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Empty(t, r.stderr)
}
