package main

import (
	"context"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

var completionCmd = &command{
	name:    "completion",
	args:    "bash|zsh|fish",
	summary: "Print a shell completion script for idem's commands and flags",
	example: `idem completion bash > /etc/bash_completion.d/idem  # bash, every shell
source <(idem completion bash)                     # bash, this shell only
idem completion zsh > "${fpath[1]}/_idem"           # zsh (compinit must run)
idem completion fish > ~/.config/fish/completions/idem.fish`,
	offline: true,
	words:   []string{"bash", "zsh", "fish"},
	setup: func(fs *pflag.FlagSet) runFunc {
		return func(ctx context.Context, e *env, args []string) error {
			if len(args) != 1 {
				return usagef("takes one shell: bash, zsh or fish")
			}
			// cobra's scripts ask the binary what to offer (idem __complete
			// <words>), so a new command or flag completes without a new script.
			switch args[0] {
			case "bash":
				return e.root.GenBashCompletionV2(e.stdout, true)
			case "zsh":
				return e.root.GenZshCompletion(e.stdout)
			case "fish":
				return e.root.GenFishCompletion(e.stdout, true)
			}
			return usagef("unknown shell %q: use bash, zsh or fish", args[0])
		}
	},
}

// completeWords completes a command's first positional word from words (migrate:
// up, down, list). On an empty word it offers the command's flags too, as it
// does its subcommands: cobra alone offers flags only once the word starts with
// "-".
func completeWords(words ...string) cobra.CompletionFunc {
	return func(cmd *cobra.Command, args []string, toComplete string) ([]cobra.Completion, cobra.ShellCompDirective) {
		var out []cobra.Completion
		if len(args) == 0 {
			for _, w := range words {
				if strings.HasPrefix(w, toComplete) {
					out = append(out, w)
				}
			}
		}
		if toComplete == "" {
			offer := func(f *pflag.Flag) {
				if !f.Hidden && !f.Changed {
					out = append(out, cobra.CompletionWithDesc("--"+f.Name, f.Usage))
				}
			}
			cmd.NonInheritedFlags().VisitAll(offer)
			cmd.InheritedFlags().VisitAll(offer)
		}
		return out, cobra.ShellCompDirectiveNoFileComp
	}
}
