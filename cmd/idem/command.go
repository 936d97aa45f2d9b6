package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"cmp"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/text"
	"github.com/idemkit/idem/shard"
)

const defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// pgTargetVars are the libpq variables that name a server or a login. When one of
// them is set and neither --database-url nor DATABASE_URL is, idem connects as psql
// would: with those variables and libpq's defaults (pgx's ParseConfig("")). The
// others (PGPASSWORD, PGCONNECT_TIMEOUT, PGAPPNAME, …) apply to any DSN that does
// not set them, the default one included.
var pgTargetVars = []string{"PGHOST", "PGPORT", "PGUSER", "PGDATABASE", "PGSERVICE", "PGSSLMODE"}

// runFunc runs a command after its flags are parsed; args are the positional ones.
type runFunc func(ctx context.Context, e *env, args []string) error

// runWith is the run function of a command whose flags fill in o: run gets o as
// the parsed flags left it.
func runWith[O any](o *O, run func(ctx context.Context, e *env, args []string, o O) error) runFunc {
	return func(ctx context.Context, e *env, args []string) error { return run(ctx, e, args, *o) }
}

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
	setup func(fs *pflag.FlagSet) runFunc
	// words are what its first positional argument completes to (migrate: up,
	// down, list).
	words []string
	// files are its flags whose value is a path: they complete to file names
	// (every other flag's value completes to nothing).
	files []string
	// offline: the command never connects (version, completion): --help leaves the
	// connection flags out of its list.
	offline bool
}

// env is what a running command gets: the global flags, the output streams, the
// terminal to ask questions on, and a lazily opened pool.
type env struct {
	stdout, stderr io.Writer
	// terminal is where a confirmation is read from when idem runs on a
	// terminal; nil when it does not, and a command that would ask needs its
	// --yes flag instead.
	terminal io.Reader
	// databaseURL is the DSN; "" means the PG* variables (pgx's ParseConfig("")).
	databaseURL string
	schema      string
	// schemaGiven: --schema was on the command line (not IDEM_SCHEMA, not the
	// default).
	schemaGiven bool
	// json: --json was given. Output is JSON, errors are one JSON object on
	// stderr, and nothing else goes to stderr but JSON log lines (no progress,
	// no question on the terminal).
	json bool
	pool *pgxpool.Pool
	// databaseGiven: --database-url was on the command line.
	databaseGiven bool
	// The shard map: --shard flags or the --shards file ($IDEM_SHARDS), its specs
	// and route table once read, and its pools once opened.
	shardFlags shardFlags
	shardsPath string
	specs      []shardSpec
	routeTable map[string]string
	shards     *shard.Map
	// pinned are the time flags given as an age (--since 1h), as absolute flags
	// (--since 2026-11-25T09:00:00Z): a list's next page reads the same window.
	pinned []string
	// root is the command tree of this invocation (completion generates its
	// scripts from it).
	root *cobra.Command
}

// clockKey is the context key of the clock that a command's ages (--since 1h)
// are read against: a func() time.Time, time.Now when absent. Tests set it.
type clockKey struct{}

// nowOf is the invocation's clock reading.
func nowOf(ctx context.Context) time.Time {
	if clock, ok := ctx.Value(clockKey{}).(func() time.Time); ok {
		return clock()
	}
	return time.Now()
}

// usageError is bad usage: exit code 2.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error {
	return &usageError{msg: fmt.Sprintf(format, args...)}
}

// globalFlags declares the flags every command takes on fs (the root command's
// persistent flags: before or after the command's name).
func (e *env) globalFlags(fs *pflag.FlagSet) {
	fs.StringVar(&e.databaseURL, "database-url", "", "Postgres DSN (default $DATABASE_URL, else the PG* variables, else "+defaultDatabaseURL+")")
	fs.StringVar(&e.schema, "schema", "", "schema of the idem tables (default $IDEM_SCHEMA, else "+inbox.DefaultSchema+")")
	fs.BoolVar(&e.json, "json", false, "JSON output for scripts (errors too, on stderr)")
	fs.Var(&e.shardFlags, "shard", "a shard of a shard map (schema default idem); repeat it for each shard, in place of --database-url and --schema")
	fs.StringVar(&e.shardsPath, "shards", "", "JSON file of the shard map: {\"shards\": [{\"name\", \"url\", \"schema\"}, ...], \"table\": {tenant: shard}} (default $IDEM_SHARDS)")
}

var globalFlagNames = map[string]bool{"database-url": true, "schema": true, "json": true, "shard": true, "shards": true}

// resolve fills in what the global flags leave unset, from the environment.
func (e *env) resolve(fs *pflag.FlagSet) {
	e.schemaGiven = flagGiven(fs, "schema")
	e.databaseGiven = flagGiven(fs, "database-url")
	if !e.schemaGiven {
		e.schema = cmp.Or(os.Getenv("IDEM_SCHEMA"), inbox.DefaultSchema)
	}
	if e.databaseURL == "" {
		e.databaseURL = os.Getenv("DATABASE_URL")
	}
	if e.databaseURL == "" && !pgEnvSet() {
		e.databaseURL = defaultDatabaseURL
	}
}

func pgEnvSet() bool {
	for _, v := range pgTargetVars {
		if os.Getenv(v) != "" {
			return true
		}
	}
	return false
}

// redactDSN is what error messages are masked against: the DSN, or in PG*-variable
// mode a DSN that carries PGPASSWORD.
func (e *env) redactDSN() string {
	if e.databaseURL != "" {
		return e.databaseURL
	}
	if p := os.Getenv("PGPASSWORD"); p != "" {
		return "password='" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(p) + "'"
	}
	return ""
}

// execute runs c once cobra has parsed its flags (fs, the global ones merged in)
// and returns the exit code.
func (e *env) execute(ctx context.Context, c *command, fs *pflag.FlagSet, runIt runFunc, args []string) int {
	e.resolve(fs)
	e.pinned = resolveAges(fs, nowOf(ctx))
	if err := e.resolveShards(); err != nil {
		return e.report(c.name, err)
	}
	if err := pgschema.Validate(e.schema); err != nil {
		return e.report(c.name, usagef("--schema %q is not a plain lower-case identifier (letters, digits, _; at most 63)", e.schema))
	}
	defer func() {
		if e.pool != nil {
			e.pool.Close()
		}
		e.closeShards(e.shards)
	}()
	return e.report(c.name, runIt(ctx, e, args))
}

// wantsJSON reports whether args ask for JSON anywhere (--json, --json=true, or
// any value strconv.ParseBool takes; the last one wins; a value it refuses counts
// as asking; -json, which pflag refuses, counts too), for errors found before, or instead of, parsing
// the flags, and where a flag took --json as its value ("--schema --json").
func wantsJSON(args []string) bool {
	want := false
	for _, a := range args {
		name, value, hasValue := strings.Cut(a, "=")
		if name != "--json" && name != "-json" {
			continue
		}
		if !hasValue {
			want = true
			continue
		}
		// A value pflag refuses is an error to report, as JSON.
		b, err := strconv.ParseBool(value)
		want = b || err != nil
	}
	return want
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
	if err := e.oneDatabase("this command"); err != nil {
		return nil, err
	}
	cfg, err := poolConfig(e.databaseURL)
	if err != nil {
		return nil, &dsnError{err: err, fromEnv: e.databaseURL == ""}
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, &dsnError{err: err, fromEnv: e.databaseURL == ""}
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, &connectError{host: fmt.Sprintf("%s:%d", cfg.ConnConfig.Host, cfg.ConnConfig.Port), err: err}
	}
	e.pool = pool
	return pool, nil
}

// poolConfig is the config of a pool the CLI opens on a database (or a shard):
// four connections, application_name idem-cli, and a connect timeout of at most
// 10 s.
func poolConfig(url string) (*pgxpool.Config, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = 4
	cfg.ConnConfig.RuntimeParams["application_name"] = "idem-cli"
	if cfg.ConnConfig.ConnectTimeout == 0 || cfg.ConnConfig.ConnectTimeout > 10*time.Second {
		cfg.ConnConfig.ConnectTimeout = 10 * time.Second
	}
	return cfg, nil
}

// admin connects and returns the operator API on the schema. Its audit lines (a
// forget) go to stderr, as JSON with --json.
func (e *env) admin(ctx context.Context) (*admin.Admin, error) {
	if e.shardsGiven() {
		m, err := e.shardMap(ctx)
		if err != nil {
			return nil, err
		}
		return admin.New(admin.Config{Shards: m, Logger: e.logger()})
	}
	pool, err := e.connect(ctx)
	if err != nil {
		return nil, err
	}
	return admin.New(admin.Config{Pool: pool, Schema: e.schema, Logger: e.logger()})
}

func (e *env) logger() *slog.Logger {
	if e.json {
		return slog.New(slog.NewJSONHandler(e.stderr, nil))
	}
	return slog.New(slog.NewTextHandler(e.stderr, nil))
}

// dsnError: the DSN does not parse.
type dsnError struct {
	err     error
	fromEnv bool
}

func (e *dsnError) Error() string {
	if e.fromEnv {
		return "bad PG* environment variables: " + e.err.Error()
	}
	return "bad --database-url: " + e.err.Error()
}
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

// notes is where a command writes progress and notes for people: stderr, or
// nowhere with --json, where stderr holds JSON only (an error, log lines).
func (e *env) notes() io.Writer {
	if e.json {
		return io.Discard
	}
	return e.stderr
}

// question is the confirmation a dangerous command asks for.
type question struct {
	// yes: --yes was given, so there is nothing to ask.
	yes bool
	// refused is the confirmation_required error returned when it cannot ask:
	// without a terminal, or with --json.
	refused error
	// want is the answer that confirms. It must be typed exactly, but for
	// spaces around it when it has none itself.
	want string
	// shown is how the question names the answer ("yes", "the key (k)"), and
	// action what typing it does ("revert").
	shown, action string
}

// errCancelled: the answer on the terminal was not the one asked for.
var errCancelled = errors.New("cancelled; nothing was changed")

// confirmed gets a dangerous change confirmed: by --yes, else by the answer
// typed on the terminal. With --json it never asks (stderr holds JSON only), and
// like a run without a terminal it returns q.refused.
func (e *env) confirmed(q question) error {
	if q.yes {
		return nil
	}
	if e.terminal == nil || e.json {
		return q.refused
	}
	fmt.Fprintf(e.stderr, "Type %s to %s, anything else to cancel: ", q.shown, q.action)
	answer, _ := bufio.NewReader(e.terminal).ReadString('\n')
	answer = strings.TrimRight(answer, "\r\n")
	if answer != q.want && (q.want != strings.TrimSpace(q.want) || strings.TrimSpace(answer) != q.want) {
		return errCancelled
	}
	return nil
}

// nextArgs are the flags that ask for the page after cursor, to be added to
// the command line of this one (a flag given twice takes its last value): the
// cursor, and the time flags given as an age, as the times they were read as.
func (e *env) nextArgs(cursor string) []string {
	return append([]string{"--after", cursor}, e.pinned...)
}

// nextPage tells, on stderr, that a --json list goes on: one JSON object with the
// cursor of the next page and the flags that ask for it (stdout holds the page
// alone).
func (e *env) nextPage(c, what, cursor string) {
	args := e.nextArgs(cursor)
	b, _ := json.Marshal(map[string]any{"next_after": cursor, "next_args": args,
		"message": fmt.Sprintf("idem %s: more %s follow; next page: %s", c, what, strings.Join(args, " "))})
	fmt.Fprintf(e.stderr, "%s\n", b)
}

// listPage is one page of a keyset-paged list: the command that printed it, what
// it lists (plural), its items, and the cursor of the next page ("" on the last).
type listPage[T any] struct {
	command, what string
	items         []T
	next          string
}

// writePage prints a page: with --json its items (and, on stderr, the next page's
// cursor); else none when it is empty, or the table and how to ask for the next
// page.
func writePage[T any](e *env, p listPage[T], none string, table func() error) error {
	if e.json {
		if p.next != "" {
			e.nextPage(p.command, p.what, p.next)
		}
		return e.writeJSON(p.items)
	}
	if len(p.items) == 0 {
		fmt.Fprintln(e.stdout, none)
		return nil
	}
	if err := table(); err != nil {
		return err
	}
	if p.next != "" {
		fmt.Fprintf(e.stdout, "(first %d shown; next page: %s)\n", len(p.items), strings.Join(e.nextArgs(p.next), " "))
	}
	return nil
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

// clip shortens s for a table cell (the JSON output has it whole), and shows
// control characters as escapes so that stored text cannot move the terminal's
// cursor or change its colours.
func clip(s string, n int) string {
	s = printable(s)
	if len(s) <= n {
		return dash(s)
	}
	return text.Clip(s, n-1) // n-1 bytes and "…" fill about n columns
}

// printable replaces newlines and tabs with a space and every other control
// character with \xNN.
func printable(s string) string {
	var b strings.Builder
	for _, r := range s {
		switch {
		case r == '\n' || r == '\r' || r == '\t':
			b.WriteByte(' ')
		case r < 0x20 || r == 0x7f || (r >= 0x80 && r < 0xa0):
			fmt.Fprintf(&b, `\x%02x`, r)
		default:
			b.WriteRune(r)
		}
	}
	return b.String()
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

func noArgs(args []string) error {
	if len(args) > 0 {
		return usagef("takes no arguments, got %q", args)
	}
	return nil
}

// pageFlags declares the --limit (at most limit of what by default) and --after
// flags of a command that lists a page at a time.
func pageFlags(fs *pflag.FlagSet, p *admin.Page, limit int, what string) {
	fs.IntVar(&p.Limit, "limit", limit, "at most this many "+what)
	fs.StringVar(&p.After, "after", "", "the cursor of the page to show, from the previous page")
}

// checkLimit refuses a --limit the operator API would refuse.
func checkLimit(limit int) error {
	if limit < 1 || limit > admin.MaxLimit {
		return usagef("--limit must be from 1 to %d", admin.MaxLimit)
	}
	return nil
}
