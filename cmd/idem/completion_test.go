package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// completionCases are (words typed, the current word last) and what must and must
// not be offered.
var completionCases = []struct {
	words     []string
	want, not []string
}{
	{[]string{""}, []string{"migrate", "inspect", "effects", "inbox", "console", "completion", "version", "--json", "--schema"}, []string{"list", "--kind"}},
	{[]string{"eff"}, []string{"effects"}, []string{"migrate"}},
	{[]string{"effects", ""}, []string{"list", "requeue"}, []string{"migrate", "--kind"}},
	{[]string{"effects", "list", "--st"}, []string{"--state", "--stuck"}, []string{"--kind"}},
	{[]string{"effects", "requeue", "--"}, []string{"--kind", "--key", "--all-dead", "--tenant", "--json"}, []string{"--state"}},
	{[]string{"--schema", "idem", "eff"}, []string{"effects"}, nil},
	{[]string{"--json", "effects", "list", "--kind", "email", "--li"}, []string{"--limit"}, nil},
	{[]string{"migrate", ""}, []string{"up", "down", "list", "--yes"}, []string{"migrate"}},
	{[]string{"bench", "-"}, []string{"-n", "--concurrency"}, nil},
	{[]string{"completion", ""}, []string{"bash", "zsh", "fish"}, nil},
	{[]string{"forget", "--"}, []string{"--reason", "--by", "--yes", "--consumer"}, nil},
	{[]string{"failures", "--co"}, []string{"--code", "--consumer"}, []string{"--kind"}},
	{[]string{"console", "--"}, []string{"--addr", "--read-only", "--allow-remote", "--allow-host"}, nil},
}

func writeScript(t *testing.T, shell string) string {
	t.Helper()
	r := runCLI(t, "completion", shell).ok(t)
	require.NotEmpty(t, r.stdout)
	path := filepath.Join(t.TempDir(), "idem."+shell)
	require.NoError(t, os.WriteFile(path, []byte(r.stdout), 0o644))
	return path
}

// completionEnv is the environment a shell runs a completion script in: the
// scripts ask the idem binary what to offer (idem __complete <words>), so a
// freshly built one is first on PATH.
func completionEnv(t *testing.T) []string {
	t.Helper()
	bin := buildIdem(t)
	return append(os.Environ(), "PATH="+filepath.Dir(bin)+string(os.PathListSeparator)+os.Getenv("PATH"))
}

// bashCompletion stands in for what bash and the bash-completion package give a
// completion function on Tab: _get_comp_words_by_ref (from the package) reads
// COMP_WORDS and COMP_CWORD, and compopt (a builtin that works only inside
// completion) does nothing.
const bashCompletion = `_get_comp_words_by_ref() { cur="${COMP_WORDS[COMP_CWORD]}"; prev="${COMP_WORDS[COMP_CWORD-1]}"; words=("${COMP_WORDS[@]}"); cword=$COMP_CWORD; }
compopt() { :; }
COMP_TYPE=9
`

func checkOffered(t *testing.T, shell string, words []string, got string, want, not []string) {
	t.Helper()
	offered := strings.Fields(got)
	for _, w := range want {
		require.Contains(t, offered, w, "%s: idem %q offers %q", shell, words, offered)
	}
	for _, w := range not {
		require.NotContains(t, offered, w, "%s: idem %q", shell, words)
	}
}

// The bash script completes commands, subcommands and flags, skipping the values
// of flags that take one: bash runs it as it would on Tab.
func TestCompletionBash(t *testing.T) {
	t.Parallel()
	bash, err := exec.LookPath("bash")
	require.NoError(t, err, "bash is needed to test the bash completion")
	script := writeScript(t, "bash")
	env := completionEnv(t)
	for _, c := range completionCases {
		words := append([]string{"idem"}, c.words...)
		var quoted []string
		for _, w := range words {
			quoted = append(quoted, shellQuote(w))
		}
		prog := bashCompletion + `source ` + shellQuote(script) + `
COMP_WORDS=(` + strings.Join(quoted, " ") + `)
COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 ))
COMPREPLY=()
__start_idem
echo "${COMPREPLY[*]}"`
		cmd := exec.Command(bash, "--norc", "--noprofile", "-c", prog)
		cmd.Env = env
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "%s", out)
		checkOffered(t, "bash", c.words, string(out), c.want, c.not)
	}
	// After a flag that takes a value, nothing is offered.
	cmd := exec.Command(bash, "--norc", "-c", bashCompletion+`source `+shellQuote(script)+`
COMP_WORDS=(idem effects list --kind ""); COMP_CWORD=4; COMPREPLY=(); __start_idem; echo "n=${#COMPREPLY[@]}"`)
	cmd.Env = env
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Equal(t, "n=0\n", string(out))
	require.Contains(t, string(mustRead(t, script)), "-F __start_idem idem")
}

// zsh and fish run their scripts the same way when they are installed (Debian:
// apt-get install -y zsh fish); without them the scripts' text is checked.
func TestCompletionZshAndFish(t *testing.T) {
	t.Parallel()
	env := completionEnv(t)
	for _, shell := range []string{"zsh", "fish"} {
		script := writeScript(t, shell)
		// The script asks the binary what to offer: what it gets is checked here,
		// with the shell or without it.
		require.Contains(t, string(mustRead(t, script)), "__complete")
		require.Contains(t, runCLI(t, "__complete", "effects", "").ok(t).stdout, "requeue")
		require.Contains(t, runCLI(t, "__complete", "effects", "requeue", "--").ok(t).stdout, "all-dead")
		path, err := exec.LookPath(shell)
		if err != nil {
			t.Fatalf("%s is not installed, so its completion script cannot be run: apt-get install -y %s (.ci/run installs it)", shell, shell)
		}
		for _, c := range completionCases {
			var out []byte
			switch shell {
			case "zsh":
				// Outside the completion system, words and CURRENT are plain
				// variables and compadd is ours: it prints what it is given that
				// starts with the current word, as zsh's would offer.
				var quoted []string
				for _, w := range append([]string{"idem"}, c.words...) {
					quoted = append(quoted, shellQuote(w))
				}
				// _describe is ours too: it prints the names of the array it
				// is given ("name:description"), and compdef and _arguments
				// do nothing.
				prog := `compadd() { [[ $1 == -- ]] && shift; local w; for w in "$@"; do [[ $w == "${words[CURRENT]}"* ]] && print -r -- "$w"; done; return 0; }
_describe() { while [[ $1 == -* ]]; do shift; done; local c; for c in "${(@P)2}"; do print -r -- "${c%%:*}"; done; return 0; }
_arguments() { return 1; }
compdef() { :; }
source ` + shellQuote(script) + `
words=(` + strings.Join(quoted, " ") + `)
CURRENT=${#words}
_idem`
				cmd := exec.Command(path, "-f", "-c", prog)
				cmd.Env = env
				out, err = cmd.CombinedOutput()
			case "fish":
				line := "idem " + strings.Join(c.words, " ")
				cmd := exec.Command(path, "--no-config", "-c", "source "+shellQuote(script)+"; complete -C "+shellQuote(line))
				cmd.Env = env
				out, err = cmd.CombinedOutput()
			}
			require.NoError(t, err, "%s: %s", shell, out)
			var first []string
			for _, l := range strings.Split(string(out), "\n") {
				if f := strings.Fields(l); len(f) > 0 {
					first = append(first, f[0]) // fish prints "candidate<TAB>description"
				}
			}
			want := c.want
			if shell == "fish" && !strings.HasPrefix(c.words[len(c.words)-1], "-") {
				want = nil // fish offers options only once the word starts with -
				for _, w := range c.want {
					if !strings.HasPrefix(w, "-") {
						want = append(want, w)
					}
				}
			}
			checkOffered(t, shell, c.words, strings.Join(first, " "), want, c.not)
		}
	}
}

func mustRead(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	return b
}

func TestCompletionUsage(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{{"completion"}, {"completion", "tcsh"}, {"completion", "bash", "zsh"}} {
		r := runCLI(t, args...)
		require.Equal(t, exitUsage, r.code, "%q", args)
	}
}
