package main

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/cmd/idem/internal/scratch"
	"github.com/idemkit/idem/internal/pgtest"
)

// idem demo and idem bench refuse a schema they did not make, with exit code 2
// and a message that says what to do, and the user's data is still there.
func TestDemoAndBenchNeverDropAUsersSchema(t *testing.T) {
	b := setup(t, pgtest.Options{NoMigrate: true})
	ctx := context.Background()
	_, err := b.pool.Exec(ctx, `CREATE TABLE `+b.schema+`.customers (id int PRIMARY KEY, name text);
		INSERT INTO `+b.schema+`.customers VALUES (1, 'ada'), (2, 'grace')`)
	require.NoError(t, err)

	for _, args := range [][]string{
		{"demo", "-n", "10", "--schema", b.schema},
		{"bench", "-n", "10", "--bench-schema", b.schema},
	} {
		r := runCLI(t, append(args, "--database-url", pgtest.URL())...)
		require.Equal(t, exitUsage, r.code, "%q\n%s", args, r.stderr)
		require.Contains(t, r.stderr, `schema "`+b.schema+`" is not a scratch schema of idem's: it exists and has no idem scratch marker`)
		require.Contains(t, r.stderr, "it never drops or empties yours")
		require.Contains(t, r.stderr, "Name a schema that does not exist yet")
		require.Empty(t, r.stdout)
	}
	require.Equal(t, 2, pgtest.Count(t, b.pool, `SELECT count(*) FROM `+b.schema+`.customers`))
	require.Equal(t, 1, pgtest.Count(t, b.pool, `SELECT count(*) FROM pg_tables WHERE schemaname = $1`, b.schema),
		"nothing was created in the user's schema")
}

// public, and idem's own default schema, are refused by both tools.
func TestDemoAndBenchRefusePublic(t *testing.T) {
	t.Parallel()
	pgtest.Require(t)
	for _, args := range [][]string{
		{"demo", "-n", "10", "--schema", "public"},
		{"bench", "-n", "10", "--bench-schema", "public"},
		{"bench", "-n", "10", "--bench-schema", "idem"},
	} {
		r := runCLI(t, append(args, "--database-url", pgtest.URL())...)
		require.Equal(t, exitUsage, r.code, "%q\n%s", args, r.stderr)
		require.Contains(t, r.stderr, "is not a scratch schema of idem's: it is", args)
		require.Empty(t, r.stdout)
	}
}

// A second demo (or bench) on a schema that a demo is using refuses at once with
// exit code 1 and changes nothing; the first one finishes with nothing lost.
func TestTwoRunsOnOneSchema(t *testing.T) {
	t.Parallel()
	pgtest.Require(t)
	schema := pgtest.NewSchemaName()
	t.Cleanup(func() { pgtest.DropSchema(t, schema) })
	admin := pgtest.NewPool(t, "public", 1)

	type outcome struct {
		code           int
		stdout, stderr string
	}
	first := make(chan outcome, 1)
	go func() {
		var out, errOut bytes.Buffer
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		code := run(ctx, []string{"demo", "-n", "300", "--seed", "5", "--json", "--database-url", pgtest.URL(), "--schema", schema}, &out, &errOut)
		first <- outcome{code, out.String(), errOut.String()}
	}()
	// Wait until the first run holds the schema.
	deadline := time.Now().Add(30 * time.Second)
	for {
		held, err := scratch.InUse(context.Background(), admin, schema)
		require.NoError(t, err)
		if held {
			break
		}
		select {
		case o := <-first:
			t.Fatalf("the first demo ended before it was seen holding its schema:\n%s\n%s", o.stdout, o.stderr)
		default:
		}
		require.True(t, time.Now().Before(deadline), "the first demo never took its schema")
		time.Sleep(20 * time.Millisecond)
	}

	for _, args := range [][]string{
		{"demo", "-n", "10", "--schema", schema},
		{"bench", "-n", "10", "--bench-schema", schema},
	} {
		r := runCLI(t, append(args, "--database-url", pgtest.URL())...)
		require.Equal(t, exitFailure, r.code, "%q\n%s", args, r.stderr)
		require.Contains(t, r.stderr, "scratch schema in use by another run: schema "+schema)
		require.Contains(t, r.stderr, "Wait for that run to end")
	}

	o := <-first
	require.Equal(t, exitOK, o.code, "stdout:\n%s\nstderr:\n%s", o.stdout, o.stderr)
	var out demoJSON
	result{stdout: o.stdout}.decode(t, &out)
	require.True(t, out.OK)
	require.Equal(t, 300, out.Report.CommittedOnce)
	require.Zero(t, out.Report.Lost)
	require.Zero(t, out.Report.CommittedTwice)
}
