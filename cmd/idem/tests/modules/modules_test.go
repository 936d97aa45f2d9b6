package modules

import (
	"bufio"
	"bytes"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// repoRoot is the repository's root, from this package's folder.
const repoRoot = "../../../.."

// toolOnly are module path prefixes that only the tools' module (cmd/idem) and the
// examples may need: a library user must never get them in their module graph.
var toolOnly = []string{
	"github.com/chromedp/",                      // the console's browser test
	"github.com/pressly/goose",                  // the goose migration test
	"github.com/golang-migrate/",                // the golang-migrate migration test
	"github.com/grafana/grafana-foundation-sdk", // the dashboard audit
	"github.com/emersion/go-smtp",               // the demo's and the examples' SMTP
	"github.com/yuin/goldmark",                  // the docs' snippet and link checks
	"github.com/spf13/",                         // the CLI's commands and flags (cobra, pflag)
}

// brokerOnly are module path prefixes that only the adapter modules
// (adapters/kafka, adapters/nats), the tools and the examples may need: a library
// user who uses no broker, or one broker, must not get them, or the other
// broker's, with the library.
var brokerOnly = []string{
	"github.com/segmentio/kafka-go",           // the Kafka adapter's client
	"github.com/twmb/franz-go",                // kfake, the Kafka adapter's test broker, and its client
	"github.com/nats-io/",                     // nats.go, the NATS adapter's client, and nats-server
	"github.com/ThreeDotsLabs/watermill-nats", // the NATS adapter's comparison tests
}

// TestLibraryModuleNeedsNoToolDependency lists the library module's whole module
// graph, alone (GOWORK=off: the workspace would add the other modules), and fails
// if a tool-only or broker-only dependency is in it.
func TestLibraryModuleNeedsNoToolDependency(t *testing.T) {
	t.Parallel()
	cmd := exec.Command("go", "list", "-mod=readonly", "-m", "all")
	cmd.Dir = repoRoot
	cmd.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	require.NoError(t, err, "go list -m all in the library module: %s", stderr.String())

	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	require.Equal(t, "github.com/idemkit/idem", lines[0], "the first module listed is the library itself")
	require.Greater(t, len(lines), 10, "the library's graph holds its dependencies")
	for _, line := range lines[1:] {
		for _, prefix := range toolOnly {
			require.False(t, strings.HasPrefix(line, prefix),
				"the library module's graph holds %s: move the code that needs it into cmd/idem or examples/ and run scripts/tidy", line)
		}
		for _, prefix := range brokerOnly {
			require.False(t, strings.HasPrefix(line, prefix),
				"the library module's graph holds %s: move the code that needs it into adapters/kafka or adapters/nats and run scripts/tidy", line)
		}
	}
}

// TestEveryModuleIsInTheWorkspaceAndTested finds every go.mod in the repository
// and checks that go.work uses it and that the README's test command covers it.
func TestEveryModuleIsInTheWorkspaceAndTested(t *testing.T) {
	t.Parallel()
	var modules []string
	require.NoError(t, filepath.WalkDir(repoRoot, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "testdata") {
			return filepath.SkipDir
		}
		if !d.IsDir() && d.Name() == "go.mod" {
			rel, err := filepath.Rel(repoRoot, filepath.Dir(path))
			if err != nil {
				return err
			}
			modules = append(modules, filepath.ToSlash(rel))
		}
		return nil
	}))
	require.Contains(t, modules, ".")
	require.Contains(t, modules, "cmd/idem")

	work, err := os.ReadFile(filepath.Join(repoRoot, "go.work"))
	require.NoError(t, err)
	used := map[string]bool{}
	in := false
	for _, line := range strings.Split(string(work), "\n") {
		line = strings.TrimSpace(line)
		switch {
		case line == "use (":
			in = true
		case in && line == ")":
			in = false
		case in && line != "":
			used[strings.TrimPrefix(line, "./")] = true
		}
	}

	readme, err := os.ReadFile(filepath.Join(repoRoot, "README.md"))
	require.NoError(t, err)
	var command string
	sc := bufio.NewScanner(bytes.NewReader(readme))
	for sc.Scan() {
		if line := strings.TrimSpace(sc.Text()); strings.HasPrefix(line, "go vet ") && strings.Contains(line, "go test ") {
			command = line
			break
		}
	}
	require.NotEmpty(t, command, "README.md gives the test command (go vet ... && go test ...)")
	vet, test, ok := strings.Cut(command, "&&")
	require.True(t, ok, command)

	for _, m := range modules {
		require.True(t, used[m], "go.work does not use %s", m)
		pattern := "./..."
		if m != "." {
			pattern = "./" + m + "/..."
		}
		require.Contains(t, strings.Fields(vet), pattern, "the README's test command vets %s", m)
		require.Contains(t, strings.Fields(test), pattern, "the README's test command tests %s", m)
	}
}
