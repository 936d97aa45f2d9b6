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
	"cmp"
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/spf13/cobra"
	"golang.org/x/term"
)

// commands is the command table. A new command is one file with a command value
// and one line here; commandTree makes the cobra commands of it. It is filled
// in init: the groups' help reads the table.
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
	// A person may be typing on stdin: a terminal (not /dev/null, a file or a
	// pipe, which CI jobs and cron give).
	if term.IsTerminal(int(os.Stdin.Fd())) {
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
	e := &env{stdout: stdout, stderr: stderr, terminal: terminal, json: wantsJSON(args)}
	if err := checkLeadingGlobals(args); err != nil {
		return e.reportTop(err)
	}
	if len(args) > 0 && (args[0] == "--version" || args[0] == "-version") {
		args = append([]string{"version"}, args[1:]...)
	}
	exit := exitOK
	root := e.commandTree(ctx, &exit)
	// Declaring --json set it to its default: it asks again, for the errors
	// found before or instead of parsing it.
	e.json = wantsJSON(args)
	root.SetArgs(args)
	cmd, err := root.ExecuteC()
	if err != nil {
		// Every command reports its own errors (its RunE returns nil): an error
		// here is cobra's, from the command line (an unknown flag, a missing
		// value), which is bad usage. Parsing may have set --json to false on
		// its way ("--json=maybe"): the line asks for JSON or not.
		e.json = wantsJSON(args)
		if cmd == nil || cmd == root {
			return e.reportTop(usagef("idem: %v\nRun 'idem --help' for the list of commands.", err))
		}
		return e.report(strings.TrimPrefix(cmd.CommandPath(), "idem "), usagef("%v", err))
	}
	return exit
}

// commandTree builds the cobra commands of the command table: a command named by
// two words ("effects list") is a subcommand of the first, which is a command of
// the table too (failures) or a group that only names its subcommands (effects).
// The command that runs sets *exit.
func (e *env) commandTree(ctx context.Context, exit *int) *cobra.Command {
	root := &cobra.Command{
		Use:           "idem",
		Short:         "idem operates the idem inbox and effects tables",
		Args:          cobra.ArbitraryArgs,
		SilenceErrors: true,
		SilenceUsage:  true,
		// Completion is our own command (completion bash|zsh|fish), with the exit
		// codes of every other one.
		CompletionOptions: cobra.CompletionOptions{DisableDefaultCmd: true},
		RunE: func(cmd *cobra.Command, args []string) error {
			switch {
			case len(args) > 0:
				*exit = e.reportTop(usagef("idem: unknown command %q\nRun 'idem --help' for the list of commands.", args[0]))
			case e.json:
				*exit = e.reportTop(usagef("idem: no command given; run 'idem --help' for the list of commands"))
			default:
				printOverview(e.stderr)
				*exit = exitUsage
			}
			return nil
		},
		ValidArgsFunction: completeWords(),
	}
	e.root = root
	root.SetOut(e.stdout)
	root.SetErr(e.stderr)
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usagef("%v", err) })
	e.globalFlags(root.PersistentFlags())
	for _, name := range []string{"shards"} {
		_ = root.RegisterFlagCompletionFunc(name, cobra.FixedCompletions(nil, cobra.ShellCompDirectiveDefault))
	}
	root.SetUsageTemplate(usageTemplate)
	commandHelp := root.HelpFunc()
	root.SetHelpFunc(func(cmd *cobra.Command, args []string) {
		if cmd == root {
			printOverview(e.stdout)
			return
		}
		if cmd.Annotations[offlineAnnotation] != "" {
			// It never connects: of the global flags, only --json applies.
			for _, name := range []string{"database-url", "schema", "shard", "shards"} {
				root.PersistentFlags().Lookup(name).Hidden = true
			}
		}
		commandHelp(cmd, args)
	})
	root.SetHelpCommand(&cobra.Command{
		Use:   "help [command]",
		Short: "Show a command's flags and an example",
		RunE: func(_ *cobra.Command, args []string) error {
			target, rest, err := root.Find(args)
			if err != nil || len(rest) > 0 {
				*exit = e.reportTop(usagef("idem: unknown command %q\nRun 'idem --help' for the list of commands.", strings.Join(args, " ")))
				return nil
			}
			return target.Help()
		},
		ValidArgsFunction: func(cmd *cobra.Command, args []string, toComplete string) ([]cobra.Completion, cobra.ShellCompDirective) {
			var names []string
			for _, c := range root.Commands() {
				if c.IsAvailableCommand() {
					names = append(names, c.Name())
				}
			}
			return completeWords(names...)(cmd, args, toComplete)
		},
	})

	byName := map[string]*cobra.Command{}
	for _, c := range commands {
		first, second, grouped := strings.Cut(c.name, " ")
		parent := root
		if grouped {
			parent = byName[first]
			if parent == nil {
				parent = e.group(first, exit)
				byName[first] = parent
				root.AddCommand(parent)
			}
		}
		cmd := &cobra.Command{
			Use:               cmp.Or(second, first) + " " + c.args,
			Short:             c.summary,
			Example:           indent(strings.TrimSpace(c.example)),
			Args:              cobra.ArbitraryArgs,
			ValidArgsFunction: completeWords(c.words...),
		}
		if c.offline {
			cmd.Annotations = map[string]string{offlineAnnotation: "true"}
		}
		run := c.setup(cmd.Flags())
		for _, name := range c.files {
			_ = cmd.RegisterFlagCompletionFunc(name, cobra.FixedCompletions(nil, cobra.ShellCompDirectiveDefault))
		}
		cmd.RunE = func(cmd *cobra.Command, args []string) error {
			*exit = e.execute(ctx, c, cmd.Flags(), run, args)
			return nil
		}
		if !grouped {
			byName[first] = cmd
		}
		parent.AddCommand(cmd)
	}
	return root
}

// offlineAnnotation marks the cobra command of an offline command.
const offlineAnnotation = "idem-offline"

// group is the command of a word that only names subcommands ("effects"): run
// alone, or with a word that is none of them, it is bad usage.
func (e *env) group(word string, exit *int) *cobra.Command {
	subs := joinNames(subcommandsOf(word))
	return &cobra.Command{
		Use:   word + " <subcommand>",
		Short: "Subcommands: " + subs,
		Long:  fmt.Sprintf("idem %s has subcommands: %s\nRun 'idem %s <subcommand> --help' for an example.", word, subs, word),
		Args:  cobra.ArbitraryArgs,
		RunE: func(_ *cobra.Command, args []string) error {
			if len(args) > 0 {
				*exit = e.reportTop(usagef("idem %s: unknown subcommand %q: use %s\nRun 'idem %s <subcommand> --help' for an example.", word, args[0], subs, word))
			} else {
				*exit = e.reportTop(usagef("idem %s: needs a subcommand: %s\nRun 'idem %s <subcommand> --help' for an example.", word, subs, word))
			}
			return nil
		},
		ValidArgsFunction: completeWords(),
	}
}

// usageTemplate is cobra's usage text with idem's headings: the command's own
// flags, then the global ones, then its example.
const usageTemplate = `Usage:
  {{.UseLine}}{{if .HasAvailableSubCommands}}

Subcommands:{{range .Commands}}{{if .IsAvailableCommand}}
  {{rpad .Name .NamePadding }} {{.Short}}{{end}}{{end}}{{end}}{{if .HasAvailableLocalFlags}}

Flags:
{{.LocalFlags.FlagUsages | trimTrailingWhitespaces}}{{end}}{{if .HasAvailableInheritedFlags}}

Global flags (before or after the command):
{{.InheritedFlags.FlagUsages | trimTrailingWhitespaces}}{{end}}{{if .HasExample}}

Example:
{{.Example}}{{end}}
`

func indent(s string) string {
	lines := strings.Split(s, "\n")
	for i, l := range lines {
		lines[i] = "  " + l
	}
	return strings.Join(lines, "\n")
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

// checkLeadingGlobals refuses a flag before the command's name that is not a
// global flag ("idem --kind email effects list"), which cobra would hand to the
// command, and a global flag there without its value.
func checkLeadingGlobals(args []string) error {
	for len(args) > 0 && strings.HasPrefix(args[0], "-") && !isHelp(args[0]) && args[0] != "--version" && args[0] != "-version" {
		name, _, hasValue := strings.Cut(strings.TrimLeft(args[0], "-"), "=")
		switch {
		case !globalFlagNames[name]:
			return usagef("idem: unknown flag %s before the command: the global flags are --database-url, --schema and --json; a command's own flags go after its name", args[0])
		case name == "json" || hasValue:
			args = args[1:]
		case len(args) < 2:
			return usagef("idem: flag %s needs a value", args[0])
		default:
			args = args[2:]
		}
	}
	return nil
}

func isHelp(arg string) bool { return arg == "-h" || arg == "--help" }

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
