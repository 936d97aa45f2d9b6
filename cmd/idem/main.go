// Command idem operates the idem tables: it migrates the schema, answers "was this
// message processed?" (inspect, find, inbox list), shows the backlog (stats), runs
// the janitor once (gc), lists and requeues effects, forgets an inbox key, lists
// failure groups and retries, discards or releases them (failures), and
// serves a web console over the same operator API (package admin). "idem demo"
// shows the guarantee under chaos on the user's own machine.
//
// Every command takes --database-url (default $DATABASE_URL, else the PG*
// variables, else a local Postgres), --schema (default $IDEM_SCHEMA, else idem)
// and --json, before or after the command's name. Errors go to stderr (with --json
// anywhere on the line, as one JSON object); the exit code is 0 on success, 1 on a
// failure, 2 on bad usage and 3 when Postgres cannot be reached.
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
)

// commands is the command table. A new command is one file with a command value
// and one line here. It is filled in init: completion reads the table.
var commands []*command

func init() {
	commands = []*command{
		migrateCmd,
		inspectCmd,
		findCmd,
		inboxListCmd,
		statsCmd,
		gcCmd,
		effectsListCmd,
		effectsRequeueCmd,
		forgetCmd,
		failuresCmd,
		failuresShowCmd,
		failuresRetryCmd,
		failuresDiscardCmd,
		failuresReleaseCmd,
		consoleCmd,
		shardMoveCmd,
		benchCmd,
		demoCmd,
		versionCmd,
		completionCmd,
	}
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	var terminal io.Reader
	if stdinIsTerminal() {
		terminal = os.Stdin
	}
	code := runOn(ctx, os.Args[1:], terminal, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run runs one invocation of idem, with no terminal to ask questions on, and
// returns its exit code.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return runOn(ctx, args, nil, stdout, stderr)
}

// runOn is run with terminal, where a command reads a confirmation (nil: none).
func runOn(ctx context.Context, args []string, terminal io.Reader, stdout, stderr io.Writer) int {
	// --json anywhere on the line makes every error JSON, those found before a
	// command is chosen included.
	e := &env{stdout: stdout, stderr: stderr, json: wantsJSON(args)}
	globals, args, err := leadingGlobals(args)
	if err != nil {
		return e.reportTop(err)
	}
	if len(args) == 0 {
		if e.json {
			return e.reportTop(usagef("idem: no command given; run 'idem --help' for the list of commands"))
		}
		printOverview(stderr)
		return exitUsage
	}
	if isHelp(args[0]) || args[0] == "help" {
		if len(args) > 1 && args[0] == "help" {
			return runOn(ctx, append(args[1:], "--help"), terminal, stdout, stderr)
		}
		printOverview(stdout)
		return exitOK
	}
	if args[0] == "--version" || args[0] == "-version" {
		args = append([]string{"version"}, args[1:]...)
	}
	cmd, rest := lookup(args)
	if cmd == nil {
		if sub := subcommandsOf(args[0]); len(sub) > 0 {
			if len(args) > 1 && isHelp(args[1]) {
				fmt.Fprintf(stdout, "idem %s has subcommands: %s\nRun 'idem %s <subcommand> --help' for an example.\n", args[0], joinNames(sub), args[0])
				return exitOK
			}
			if len(args) > 1 && !strings.HasPrefix(args[1], "-") {
				return e.reportTop(usagef("idem %s: unknown subcommand %q: use %s\nRun 'idem %s <subcommand> --help' for an example.", args[0], args[1], joinNames(sub), args[0]))
			}
			return e.reportTop(usagef("idem %s: needs a subcommand: %s\nRun 'idem %s <subcommand> --help' for an example.", args[0], joinNames(sub), args[0]))
		}
		return e.reportTop(usagef("idem: unknown command %q\nRun 'idem --help' for the list of commands.", args[0]))
	}
	return cmd.execute(ctx, append(globals, rest...), terminal, stdout, stderr)
}

// reportTop reports a usage error found before any command was chosen; its
// message is whole ("idem: unknown command …"), and a second line, if any, is
// the hint.
func (e *env) reportTop(err error) int {
	exit, code := classify(err)
	if e.json {
		msg, hint, _ := strings.Cut(err.Error(), "\n")
		e.printErrorJSON(errorJSON{Code: code, Message: msg, Hint: hint, ExitCode: exit})
		return exit
	}
	fmt.Fprintln(e.stderr, err)
	return exit
}

// leadingGlobals takes the global flags that come before the command's name
// ("idem --json stats"), so that they can be handed to the command with the rest.
func leadingGlobals(args []string) (globals, rest []string, err error) {
	for len(args) > 0 && strings.HasPrefix(args[0], "-") && !isHelp(args[0]) && args[0] != "--version" && args[0] != "-version" {
		name, _, hasValue := strings.Cut(strings.TrimLeft(args[0], "-"), "=")
		switch {
		case !globalFlagNames[name]:
			return nil, nil, usagef("idem: unknown flag %s before the command: the global flags are --database-url, --schema and --json; a command's own flags go after its name", args[0])
		case name == "json" || hasValue:
			globals, args = append(globals, args[0]), args[1:]
		case len(args) < 2:
			return nil, nil, usagef("idem: flag %s needs a value", args[0])
		default:
			globals, args = append(globals, args[0], args[1]), args[2:]
		}
	}
	return globals, args, nil
}

// stdinIsTerminal reports whether a person may be typing on stdin: a character
// device other than /dev/null (which CI jobs and cron often give).
func stdinIsTerminal() bool {
	fi, err := os.Stdin.Stat()
	if err != nil || fi.Mode()&os.ModeCharDevice == 0 {
		return false
	}
	null, err := os.Stat(os.DevNull)
	return err != nil || !os.SameFile(fi, null)
}

func isHelp(arg string) bool { return arg == "-h" || arg == "-help" || arg == "--help" }

// lookup finds the command named by the first one or two words of args.
func lookup(args []string) (*command, []string) {
	if len(args) >= 2 {
		for _, c := range commands {
			if c.name == args[0]+" "+args[1] {
				return c, args[2:]
			}
		}
	}
	for _, c := range commands {
		if c.name == args[0] {
			return c, args[1:]
		}
	}
	return nil, nil
}

func printOverview(w io.Writer) {
	fmt.Fprint(w, `idem operates the idem inbox and effects tables.

Usage:
  idem [global flags] <command> [flags]

Commands:
`)
	for _, c := range commands {
		fmt.Fprintf(w, "  %-17s %s\n", c.name, c.summary)
	}
	fmt.Fprint(w, `
Global flags, before or after the command:
  --database-url  Postgres DSN (default $DATABASE_URL, else the PG* variables
                  (PGHOST, PGPORT, PGUSER, PGPASSWORD, PGDATABASE, PGSSLMODE, ...)
                  as psql reads them, else `+defaultDatabaseURL+`)
  --schema        schema of the idem tables (default $IDEM_SCHEMA, else idem)
  --json          JSON output for scripts; every error is one JSON object on
                  stderr, wherever --json is on the line

Durations take days too: 7d, 1d12h, 90m.

Exit codes:
  0  success
  1  failure (the error says what to do next)
  2  bad usage: unknown command or flag, a missing or bad value, a bad DSN,
     a dangerous command (migrate down, forget, failures retry|discard|release)
     without --yes
  3  cannot connect to Postgres (not running, unreachable, login refused, no such database)

Run 'idem <command> --help' for the command's flags and an example.
`)
}
