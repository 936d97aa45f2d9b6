package importrules_test

import (
	"errors"
	"fmt"
	"maps"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// surfaceBudget bounds the public surface: the top-level declarations that
// `go doc -short` prints, summed over the public packages of the core module and
// of the adapter modules. A user learns every one of them, so each must be a name
// a user types; wiring that only idem's packages share lives under internal/.
const surfaceBudget = 180

// publicDirs are the public packages, by path relative to the module, and their
// folders: the core module's but internal/, cmd/ and examples/, and the adapters'.
func publicDirs(t *testing.T) map[string]string {
	t.Helper()
	out, err := exec.Command("go", "list", "-f", "{{.ImportPath}} {{.Dir}}", module+"/...",
		module+"/adapters/kafka/...", module+"/adapters/nats/...").Output()
	if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
		t.Fatalf("go list: %v\n%s", err, ee.Stderr)
	}
	require.NoError(t, err)
	dirs := map[string]string{}
	for line := range strings.Lines(string(out)) {
		path, dir, _ := strings.Cut(strings.TrimSpace(line), " ")
		rel := strings.TrimPrefix(strings.TrimPrefix(path, module), "/")
		if internal(rel) || strings.Contains("/"+rel+"/", "/internal/") || rel == "cmd" ||
			strings.HasPrefix(rel, "cmd/") || rel == "examples" || strings.HasPrefix(rel, "examples/") {
			continue
		}
		dirs[rel] = dir
	}
	require.Contains(t, dirs, "inbox")
	return dirs
}

// TestPublicSurface counts each public package's top-level declarations as
// `go doc -short` prints them, logs the count per package, and fails when the
// sum is over surfaceBudget.
func TestPublicSurface(t *testing.T) {
	t.Parallel()
	var report strings.Builder
	total := 0
	dirs := publicDirs(t)
	for _, rel := range slices.Sorted(maps.Keys(dirs)) {
		dir := dirs[rel]
		cmd := exec.Command("go", "doc", "-short", ".")
		cmd.Dir = dir
		out, err := cmd.Output()
		if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
			t.Fatalf("go doc -short in %s: %v\n%s", dir, err, ee.Stderr)
		}
		require.NoError(t, err)
		n := strings.Count(string(out), "\n")
		total += n
		fmt.Fprintf(&report, "%4d %s\n", n, rel)
	}
	t.Logf("public surface, top-level declarations per package (go doc -short):\n%s%4d in all (budget %d)", report.String(), total, surfaceBudget)
	require.LessOrEqual(t, total, surfaceBudget, "the public surface is over its budget: move what only idem's packages use to internal/, or merge names a user would not type apart")
}
