// Command idem operates the idem tables: it migrates the schema, answers "was this
// message processed?" (inspect), shows the backlog (stats), runs the janitor once
// (gc), and lists and requeues dead effects. "idem demo" shows the guarantee under
// chaos on the user's own machine.
//
// Every command takes --database-url (default $DATABASE_URL), --schema (default
// idem) and --json. Errors go to stderr; the exit code is 0 on success, 1 on a
// failure and 2 on bad usage.
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

// commands is the command table. A new command is one file with a command value
// and one line here.
var commands = []*command{
	migrateCmd,
	inspectCmd,
	statsCmd,
	gcCmd,
	benchCmd,
	effectsListCmd,
	effectsRequeueCmd,
	demoCmd,
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

// Exit codes.
const (
	exitOK      = 0
	exitFailure = 1
	exitUsage   = 2
)

// run runs one invocation of idem, with no terminal to ask questions on, and
// returns its exit code.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return runOn(ctx, args, nil, stdout, stderr)
}

// runOn is run with terminal, where a command reads a confirmation (nil: none).
func runOn(ctx context.Context, args []string, terminal io.Reader, stdout, stderr io.Writer) int {
	if len(args) == 0 {
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
	cmd, rest := lookup(args)
	if cmd == nil {
		if sub := subcommandsOf(args[0]); len(sub) > 0 {
			if len(args) > 1 && isHelp(args[1]) {
				fmt.Fprintf(stdout, "idem %s has subcommands: %s\nRun 'idem %s <subcommand> --help' for an example.\n", args[0], joinNames(sub), args[0])
				return exitOK
			}
			fmt.Fprintf(stderr, "idem %s: needs a subcommand: %s\nRun 'idem %s <subcommand> --help' for an example.\n", args[0], joinNames(sub), args[0])
			return exitUsage
		}
		fmt.Fprintf(stderr, "idem: unknown command %q\nRun 'idem --help' for the list of commands.\n", args[0])
		return exitUsage
	}
	return cmd.execute(ctx, rest, terminal, stdout, stderr)
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
  idem <command> [flags]

Commands:
`)
	for _, c := range commands {
		fmt.Fprintf(w, "  %-17s %s\n", c.name, c.summary)
	}
	fmt.Fprint(w, `
Every command takes:
  --database-url  Postgres DSN (default $DATABASE_URL, else `+defaultDatabaseURL+`)
  --schema        schema of the idem tables (default idem)
  --json          JSON output for scripts

Exit codes: 0 success, 1 failure, 2 bad usage.
Run 'idem <command> --help' for the command's flags and an example.
`)
}
