package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/redact"
)

const defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// runFunc runs a command after its flags are parsed; args are the positional ones.
type runFunc func(ctx context.Context, e *env, args []string) error

// command is one entry of the command table.
type command struct {
	// name is one word, or two for a subcommand ("effects list").
	name string
	// args shows the positional arguments and the command's own flags in the usage
	// line.
	args    string
	summary string
	// example is shown by --help; every command has one.
	example string
	// setup declares the command's own flags on fs and returns its run function.
	setup func(fs *flag.FlagSet) runFunc
}

// env is what a running command gets: the global flags, the output streams, the
// terminal to ask questions on, and a lazily opened pool.
type env struct {
	stdout, stderr io.Writer
	// terminal is where a confirmation is read from when idem runs on a
	// terminal; nil when it does not, and a command that would ask needs its
	// --yes flag instead.
	terminal    io.Reader
	databaseURL string
	schema      string
	json        bool
	pool        *pgxpool.Pool
}

// usageError is bad usage: exit code 2.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error {
	return &usageError{msg: fmt.Sprintf(format, args...)}
}

func (c *command) execute(ctx context.Context, args []string, terminal io.Reader, stdout, stderr io.Writer) int {
	e := &env{stdout: stdout, stderr: stderr, terminal: terminal}
	fs := flag.NewFlagSet("idem "+c.name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.StringVar(&e.databaseURL, "database-url", cmp.Or(os.Getenv("DATABASE_URL"), defaultDatabaseURL), "Postgres DSN")
	fs.StringVar(&e.schema, "schema", inbox.DefaultSchema, "schema of the idem tables")
	fs.BoolVar(&e.json, "json", false, "JSON output for scripts")
	runIt := c.setup(fs)

	positional, err := parseInterleaved(fs, args)
	if errors.Is(err, flag.ErrHelp) {
		c.printHelp(stdout, fs)
		return exitOK
	}
	if err != nil {
		fmt.Fprintf(stderr, "idem %s: %v\nRun 'idem %s --help' for usage and an example.\n", c.name, err, c.name)
		return exitUsage
	}
	if err := inbox.ValidateSchema(e.schema); err != nil {
		fmt.Fprintf(stderr, "idem %s: --schema %q is not a plain lower-case identifier (letters, digits, _; at most 63)\n", c.name, e.schema)
		return exitUsage
	}
	defer func() {
		if e.pool != nil {
			e.pool.Close()
		}
	}()
	err = runIt(ctx, e, positional)
	if err == nil {
		return exitOK
	}
	// No message of ours quotes the DSN, but a driver's or a server's might: mask
	// its password in whatever is printed.
	msg := redact.Text(err.Error(), e.databaseURL)
	var ue *usageError
	if errors.As(err, &ue) {
		fmt.Fprintf(stderr, "idem %s: %s\nRun 'idem %s --help' for usage and an example.\n", c.name, msg, c.name)
		return exitUsage
	}
	fmt.Fprintf(stderr, "idem %s: %s\n", c.name, msg)
	if hint := explain(err, e); hint != "" {
		fmt.Fprintln(stderr, hint)
	}
	var ee *exitError
	if errors.As(err, &ee) {
		return ee.code
	}
	return exitFailure
}

// parseInterleaved parses flags that come before, between or after positional
// arguments ("idem migrate up --json"), which the flag package alone stops at.
func parseInterleaved(fs *flag.FlagSet, args []string) ([]string, error) {
	var positional []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		if fs.NArg() == 0 {
			return positional, nil
		}
		positional = append(positional, fs.Arg(0))
		args = fs.Args()[1:]
	}
}

func (c *command) printHelp(w io.Writer, fs *flag.FlagSet) {
	fmt.Fprintf(w, "%s\n\nUsage:\n  idem %s %s\n\nFlags:\n", c.summary, c.name, c.args)
	fs.VisitAll(func(f *flag.Flag) {
		name, usage := flag.UnquoteUsage(f)
		line := "  --" + f.Name
		if name != "" {
			line += " " + name
		}
		def := f.DefValue
		if f.Name == "database-url" {
			def = "$DATABASE_URL, else " + defaultDatabaseURL
		}
		if def != "" && def != "false" && def != "0" {
			usage += " (default " + def + ")"
		}
		fmt.Fprintf(w, "%-30s %s\n", line, usage)
	})
	fmt.Fprintf(w, "\nExample:\n%s\n", indent(strings.TrimSpace(c.example)))
}

func indent(s string) string {
	lines := strings.Split(s, "\n")
	for i, l := range lines {
		lines[i] = "  " + l
	}
	return strings.Join(lines, "\n")
}

func subcommandsOf(word string) []string {
	var out []string
	for _, c := range commands {
		if rest, ok := strings.CutPrefix(c.name, word+" "); ok {
			out = append(out, rest)
		}
	}
	return out
}

func joinNames(names []string) string { return strings.Join(names, ", ") }

// connect opens the pool once, and checks that Postgres answers.
func (e *env) connect(ctx context.Context) (*pgxpool.Pool, error) {
	if e.pool != nil {
		return e.pool, nil
	}
	cfg, err := pgxpool.ParseConfig(e.databaseURL)
	if err != nil {
		return nil, &dsnError{err: err}
	}
	cfg.MaxConns = 2
	cfg.ConnConfig.RuntimeParams["application_name"] = "idem-cli"
	if cfg.ConnConfig.ConnectTimeout == 0 || cfg.ConnConfig.ConnectTimeout > 10*time.Second {
		cfg.ConnConfig.ConnectTimeout = 10 * time.Second
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, &dsnError{err: err}
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, &connectError{host: fmt.Sprintf("%s:%d", cfg.ConnConfig.Host, cfg.ConnConfig.Port), err: err}
	}
	e.pool = pool
	return pool, nil
}

// dsnError: --database-url does not parse.
type dsnError struct{ err error }

func (e *dsnError) Error() string { return "bad --database-url: " + e.err.Error() }
func (e *dsnError) Unwrap() error { return e.err }

// connectError: Postgres did not answer, or refused us.
type connectError struct {
	host string
	err  error
}

func (e *connectError) Error() string {
	return fmt.Sprintf("cannot connect to Postgres at %s: %v", e.host, e.err)
}
func (e *connectError) Unwrap() error { return e.err }

// explain says what to do next about err, or "" when there is nothing useful to
// add.
func explain(err error, e *env) string {
	var de *dsnError
	if errors.As(err, &de) {
		return `A DSN looks like postgres://USER:PASSWORD@HOST:5432/DBNAME?sslmode=disable
(or key=value form: "host=HOST port=5432 user=USER dbname=DBNAME sslmode=disable").
Pass it as --database-url or set DATABASE_URL.`
	}
	var pgErr *pgconn.PgError
	hasPg := errors.As(err, &pgErr)
	var ce *connectError
	if errors.As(err, &ce) {
		switch {
		case hasPg && (pgErr.Code == pgerrcode.InvalidPassword || pgErr.Code == pgerrcode.InvalidAuthorizationSpecification):
			return "Postgres refused the login: check the user and password in --database-url."
		case hasPg && pgErr.Code == pgerrcode.InvalidCatalogName:
			return "That database does not exist: create it (createdb NAME) or fix the database name in --database-url."
		}
		return `Is Postgres running? Start it with:
    docker compose up -d postgres
or, on a machine with a local cluster:
    pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start
or point --database-url (or DATABASE_URL) at a server you have.`
	}
	if errors.Is(err, inbox.ErrSchemaMissing) || errors.Is(err, effects.ErrSchemaMissing) ||
		(hasPg && (pgErr.Code == pgerrcode.UndefinedTable || pgErr.Code == pgerrcode.InvalidSchemaName)) {
		return fmt.Sprintf("The idem tables are not in schema %q. Create them with:\n    idem migrate up --schema %s", e.schema, e.schema)
	}
	if errors.Is(err, inbox.ErrJanitorBusy) {
		return "Another janitor (in a consumer or dispatcher process) is running a pass on this schema and is doing the work. Try again when it is done."
	}
	return ""
}

// table writes aligned columns.
func (e *env) table(header ...string) *tabwriter.Writer {
	tw := tabwriter.NewWriter(e.stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, strings.Join(header, "\t"))
	return tw
}

func row(tw io.Writer, cells ...any) {
	parts := make([]string, len(cells))
	for i, c := range cells {
		parts[i] = fmt.Sprint(c)
	}
	fmt.Fprintln(tw, strings.Join(parts, "\t"))
}

// writeJSON prints v as indented JSON.
func (e *env) writeJSON(v any) error {
	enc := json.NewEncoder(e.stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// ts formats a time for tables: UTC, to the second, "-" for none.
func ts(t *time.Time) string {
	if t == nil || t.IsZero() {
		return "-"
	}
	return t.UTC().Format(time.RFC3339)
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// clip shortens s for a table cell; the JSON output has it whole.
func clip(s string, n int) string {
	s = strings.ReplaceAll(s, "\n", " ")
	if len(s) <= n {
		return dash(s)
	}
	return s[:n-1] + "…"
}

// age formats a duration for humans: "3d4h", "5m12s", "0s".
func age(d time.Duration) string {
	if d < 0 {
		d = 0
	}
	d = d.Round(time.Second)
	if days := d / (24 * time.Hour); days > 0 {
		return fmt.Sprintf("%dd%dh", days, (d%(24*time.Hour))/time.Hour)
	}
	return d.String()
}
