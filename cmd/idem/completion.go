package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"slices"
	"strings"
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
	setup: func(fs *flag.FlagSet) runFunc {
		return func(ctx context.Context, e *env, args []string) error {
			if len(args) != 1 {
				return usagef("takes one shell: bash, zsh or fish")
			}
			switch args[0] {
			case "bash":
				writeBash(e.stdout, completionSpec())
			case "zsh":
				writeZsh(e.stdout, completionSpec())
			case "fish":
				writeFish(e.stdout, completionSpec())
			default:
				return usagef("unknown shell %q: use bash, zsh or fish", args[0])
			}
			return nil
		}
	},
}

// spec is what the scripts complete, taken from the command table so that a new
// command or flag completes without touching this file.
type spec struct {
	// top are the first words: commands and command groups.
	top []string
	// groups are the second words of a group ("effects" → list, requeue).
	groups map[string][]string
	// flags of each command, by its full name ("effects list"), with "--".
	flags map[string][]string
	// positional words of a command (migrate: up, down, list).
	positional map[string][]string
	// valueFlags take a value: the word after them is not a command.
	valueFlags []string
	// globals are the global flags.
	globals []string
	// offline commands take --json alone of the global flags.
	offline map[string]bool
}

func completionSpec() spec {
	s := spec{groups: map[string][]string{}, flags: map[string][]string{}, offline: map[string]bool{}, positional: map[string][]string{
		"migrate":    {"up", "down", "list"},
		"completion": {"bash", "zsh", "fish"},
	}}
	values := map[string]bool{}
	for _, c := range commands {
		s.offline[c.name] = c.offline
		first, second, grouped := strings.Cut(c.name, " ")
		if !slices.Contains(s.top, first) {
			s.top = append(s.top, first)
		}
		if grouped {
			s.groups[first] = append(s.groups[first], second)
		}
		fs := flag.NewFlagSet(c.name, flag.ContinueOnError)
		e := &env{}
		e.globalFlags(fs)
		c.setup(fs)
		fs.VisitAll(func(f *flag.Flag) {
			if globalFlagNames[f.Name] {
				return
			}
			name := "--" + f.Name
			if len(f.Name) == 1 {
				name = "-" + f.Name // idem bench -n
			}
			s.flags[c.name] = append(s.flags[c.name], name)
			if b, ok := f.Value.(interface{ IsBoolFlag() bool }); !ok || !b.IsBoolFlag() {
				values[name] = true
			}
		})
		s.flags[c.name] = append(s.flags[c.name], "--help")
	}
	s.top = append(s.top, "help")
	s.positional["help"] = s.top
	s.globals = []string{"--database-url", "--schema", "--json"}
	values["--database-url"], values["--schema"] = true, true
	for f := range values {
		s.valueFlags = append(s.valueFlags, f)
	}
	slices.Sort(s.valueFlags)
	return s
}

// cases are the (command, subcommand) patterns of the scripts' case statements,
// with the words each completes; "" is "nothing yet".
func (s spec) cases() [][3]string {
	var out [][3]string
	add := func(cmd, sub string, words []string) {
		out = append(out, [3]string{cmd, sub, strings.Join(words, " ")})
	}
	add("", "", append(append(slices.Clone(s.top), s.globals...), "--help", "--version"))
	for _, first := range s.top {
		if subs, ok := s.groups[first]; ok {
			words := slices.Clone(subs)
			if own, ok := s.flags[first]; ok {
				// A group that is a command too (idem failures lists, idem
				// failures show shows): its own flags as well.
				words = append(append(words, own...), s.globals...)
			}
			add(first, "", words)
			for _, sub := range subs {
				add(first, sub, append(slices.Clone(s.flags[first+" "+sub]), s.globals...))
			}
			continue
		}
		words := append(slices.Clone(s.positional[first]), s.flags[first]...)
		switch {
		case first == "help":
		case s.offline[first]:
			words = append(words, "--json")
		default:
			words = append(words, s.globals...)
		}
		add(first, "*", words)
	}
	return out
}

// scanWords is the shell loop, the same in bash and zsh, that finds the command
// and its subcommand among the words from first up to the cursor (last), passing
// over flags and the value after each flag that takes one; it ends by opening the
// case on "$cmd/$sub". word is a word by its index i, and open starts a case
// pattern: zsh writes "(pattern)", bash "pattern)".
func scanWords(s spec, first, last, word, open string) string {
	return fmt.Sprintf(`    for ((i = %s; i < %s; i++)); do
        w="%s"
        case "$w" in
            %s%s) ((i++)); continue ;;
            %s-*) continue ;;
        esac
        if [[ -z "$cmd" ]]; then cmd="$w"; elif [[ -z "$sub" ]]; then sub="$w"; fi
    done
    case "$cmd/$sub" in
`, first, last, word, open, strings.Join(s.valueFlags, "|"), open)
}

func writeBash(w io.Writer, s spec) {
	fmt.Fprintf(w, `# bash completion for idem. Generated by 'idem completion bash'; load it with
#   source <(idem completion bash)
_idem() {
    local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD-1]}"
    local i w cmd="" sub="" words=""
    case "$prev" in
        %s) COMPREPLY=(); return ;;
    esac
%s`, strings.Join(s.valueFlags, "|"), scanWords(s, "1", "COMP_CWORD", "${COMP_WORDS[i]}", ""))
	for _, c := range s.cases() {
		pattern := fmt.Sprintf("%q", c[0]+"/"+c[1])
		if c[1] == "*" {
			pattern = c[0] + "/*" // a glob: unquoted (command names are plain words)
		}
		fmt.Fprintf(w, "        %s) words=%q ;;\n", pattern, c[2])
	}
	fmt.Fprint(w, `    esac
    COMPREPLY=($(compgen -W "$words" -- "$cur"))
}
complete -F _idem idem
`)
}

func writeZsh(w io.Writer, s spec) {
	fmt.Fprintf(w, `#compdef idem
# zsh completion for idem. Generated by 'idem completion zsh'; put it in a
# directory of $fpath as _idem, or source it after compinit.
_idem() {
    local cmd="" sub="" w i
    local -a opts
    case "${words[CURRENT-1]}" in
        (%s) return 1 ;;
    esac
%s`, strings.Join(s.valueFlags, "|"), scanWords(s, "2", "CURRENT", "${words[i]}", "("))
	for _, c := range s.cases() {
		pattern := c[0] + "/" + c[1]
		if c[1] == "*" {
			pattern = c[0] + "/*"
		} else {
			pattern = fmt.Sprintf("%q", pattern)
		}
		fmt.Fprintf(w, "        (%s) opts=(%s) ;;\n", pattern, c[2])
	}
	fmt.Fprint(w, `    esac
    compadd -- "${opts[@]}"
}
if (( $+functions[compdef] )); then
    compdef _idem idem
fi
`)
}

func writeFish(w io.Writer, s spec) {
	fmt.Fprintf(w, `# fish completion for idem. Generated by 'idem completion fish'; save it as
# ~/.config/fish/completions/idem.fish
function __idem_words
    set -l skip 0
    set -l out
    for t in (commandline -opc)[2..-1]
        if test $skip = 1
            set skip 0
            continue
        end
        switch $t
            case %s
                set skip 1
            case '-*'
            case '*'
                set -a out $t
        end
    end
    string join ' ' -- $out[1..2]
end
complete -c idem -f
`, strings.Join(s.valueFlags, " "))
	for _, c := range s.cases() {
		// The condition runs at completion time: single-quoted, so that fish does
		// not expand it when the script is loaded.
		var cond string
		switch {
		case c[0] == "":
			cond = `'test -z "$(__idem_words)"'`
		case c[1] == "":
			cond = fmt.Sprintf(`'test "$(__idem_words)" = "%s"'`, c[0])
		case c[1] == "*":
			cond = fmt.Sprintf(`'string match -q -- "%s*" "$(__idem_words)"'`, c[0])
		default:
			cond = fmt.Sprintf(`'string match -q -- "%s %s*" "$(__idem_words)"'`, c[0], c[1])
		}
		var args, longs []string
		for _, word := range strings.Fields(c[2]) {
			if name, ok := strings.CutPrefix(word, "--"); ok {
				longs = append(longs, name)
			} else {
				args = append(args, word)
			}
		}
		if len(args) > 0 {
			fmt.Fprintf(w, "complete -c idem -n %s -a %q\n", cond, strings.Join(args, " "))
		}
		for _, l := range longs {
			req := ""
			if slices.Contains(s.valueFlags, "--"+l) {
				req = " -r"
			}
			fmt.Fprintf(w, "complete -c idem -n %s -l %s%s\n", cond, l, req)
		}
	}
}
