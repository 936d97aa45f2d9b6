package main

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// No command prints the password of --database-url, whatever fails: a server that
// does not answer, a DSN that does not parse, in either DSN form.
func TestPasswordIsNeverPrinted(t *testing.T) {
	t.Parallel()
	const secret = "cli-s3cret-pw"
	for _, dsn := range []string{
		"postgres://postgres:" + secret + "@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=2",
		"postgres://postgres@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=2&password=" + secret,
		"host=127.0.0.1 port=1 user=postgres password=" + secret + " connect_timeout=2",
		"postgres://postgres:" + secret + "@127.0.0.1:notaport/postgres",
		"host=127.0.0.1 port=1 user=postgres password='" + secret + "' bogus",
	} {
		for _, args := range [][]string{
			{"migrate", "list"},
			{"migrate", "down", "--yes"},
			{"stats", "--json"},
			{"inspect", "--consumer", "c", "--key", "k"},
			{"gc"},
			{"bench", "-n", "10"},
		} {
			r := runCLI(t, append(args, "--database-url", dsn)...)
			require.NotEqual(t, exitOK, r.code, "%q with %s", args, dsn)
			require.NotEmpty(t, r.stderr)
			require.NotContains(t, r.stdout+r.stderr, secret, "%q printed the password:\n%s", args, r.stderr)
		}
	}
}
