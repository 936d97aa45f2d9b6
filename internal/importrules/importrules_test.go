package importrules_test

import (
	"encoding/json"
	"errors"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

const module = "github.com/idemkit/idem"

// pkg is what go list says about one package of the module.
type pkg struct {
	ImportPath   string
	GoFiles      []string
	Imports      []string // of its non-test files
	TestImports  []string
	XTestImports []string
}

// listPackages runs go list over the module.
func listPackages(t *testing.T) map[string]pkg {
	t.Helper()
	out, err := exec.Command("go", "list", "-json=ImportPath,GoFiles,Imports,TestImports,XTestImports", module+"/...").Output()
	if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
		t.Fatalf("go list: %v\n%s", err, ee.Stderr)
	}
	require.NoError(t, err)
	pkgs := map[string]pkg{}
	dec := json.NewDecoder(strings.NewReader(string(out)))
	for dec.More() {
		var p pkg
		require.NoError(t, dec.Decode(&p))
		pkgs[strings.TrimPrefix(strings.TrimPrefix(p.ImportPath, module), "/")] = p
	}
	require.Contains(t, pkgs, "inbox", "go list found idem's packages")
	return pkgs
}

// idem returns the idem packages among imports, relative to the module.
func idem(imports []string) []string {
	var out []string
	for _, imp := range imports {
		if imp == module || strings.HasPrefix(imp, module+"/") {
			out = append(out, strings.TrimPrefix(strings.TrimPrefix(imp, module), "/"))
		}
	}
	return out
}

func internal(rel string) bool { return rel == "internal" || strings.HasPrefix(rel, "internal/") }

func standard(imp string) bool { return !strings.Contains(strings.SplitN(imp, "/", 2)[0], ".") }

// violations checks pkgs against the rules and returns what breaks them.
func violations(pkgs map[string]pkg) []string {
	var bad []string
	// inbox, effects and shard import nothing public of idem: only internal
	// leaves, and for effects the shard map its Config takes.
	allowed := map[string][]string{"inbox": nil, "effects": {"shard"}, "shard": nil}
	for name, extra := range allowed {
		for _, imp := range idem(pkgs[name].Imports) {
			if !internal(imp) && !slices.Contains(extra, imp) {
				bad = append(bad, name+" imports "+imp+", a public idem package")
			}
		}
	}
	// The adapters import only the standard library, Watermill, their own client
	// library, the OpenTelemetry API, the Prometheus client (metrics on the
	// Registerer a config takes) and idem's internal leaves.
	clients := map[string][]string{
		"adapters/kafka": {"github.com/segmentio/kafka-go"},
		"adapters/nats":  {"github.com/nats-io/nats.go"},
	}
	for name, client := range clients {
		ok := append([]string{"github.com/ThreeDotsLabs/watermill", "go.opentelemetry.io/otel", "github.com/prometheus/client_golang"}, client...)
		for _, imp := range pkgs[name].Imports {
			switch {
			case standard(imp), strings.HasPrefix(imp, module+"/internal/"):
			case strings.HasPrefix(imp, "go.opentelemetry.io/otel/sdk"):
				bad = append(bad, name+" imports the OpenTelemetry SDK ("+imp+"); only the API is allowed")
			case !slices.ContainsFunc(ok, func(prefix string) bool { return imp == prefix || strings.HasPrefix(imp, prefix+"/") }):
				bad = append(bad, name+" imports "+imp)
			}
		}
	}
	// httpidem never imports Watermill.
	for _, imp := range pkgs["httpidem"].Imports {
		if strings.HasPrefix(imp, "github.com/ThreeDotsLabs/watermill") {
			bad = append(bad, "httpidem imports "+imp)
		}
	}
	// No non-test file under internal/ imports a public idem package, except
	// fanout, which builds a front's parts from the shard map a user writes
	// (package shard, itself a leaf), and pgtest, which migrates each test's
	// schema with package migrate. pgtest and the other test support are
	// imported by test files only.
	testSupport := map[string]bool{"internal/pgtest": true, "internal/childproc": false} // may import public idem
	for name, p := range pkgs {
		if !internal(name) {
			continue
		}
		for _, imp := range idem(p.Imports) {
			if name == "internal/fanout" && imp == "shard" {
				continue
			}
			if !testSupport[name] && !internal(imp) {
				bad = append(bad, name+" imports "+imp+", a public idem package")
			}
		}
	}
	for name := range testSupport {
		if _, ok := pkgs[name]; !ok {
			bad = append(bad, name+" is gone: remove it from testSupport")
		}
		for importer, p := range pkgs {
			if slices.Contains(idem(p.Imports), name) {
				bad = append(bad, importer+" imports the test support "+name+" outside its tests")
			}
		}
	}
	// Nothing outside cmd and examples imports them (with go.work, go list also
	// lists their modules' packages, which import their own).
	tool := func(rel string) bool {
		return rel == "cmd" || strings.HasPrefix(rel, "cmd/") || rel == "examples" || strings.HasPrefix(rel, "examples/")
	}
	for name, p := range pkgs {
		if tool(name) {
			continue
		}
		for _, imp := range idem(slices.Concat(p.Imports, p.TestImports, p.XTestImports)) {
			if tool(imp) {
				bad = append(bad, name+" imports "+imp)
			}
		}
	}
	slices.Sort(bad)
	return bad
}

// TestImportRules: the import rules hold for the module as it is.
func TestImportRules(t *testing.T) {
	t.Parallel()
	require.Empty(t, violations(listPackages(t)))
}

// TestImportRulesCatchViolations: each rule fails on a module that breaks it.
func TestImportRulesCatchViolations(t *testing.T) {
	t.Parallel()
	base := listPackages(t)
	for _, tc := range []struct {
		pkg, imp string
		test     bool
	}{
		{"inbox", module + "/consumer", false},
		{"effects", module + "/inbox", false},
		{"adapters/kafka", module + "/effects", false},
		{"adapters/kafka", "github.com/jackc/pgx/v5", false},
		{"adapters/nats", "go.opentelemetry.io/otel/sdk/trace", false},
		{"httpidem", "github.com/ThreeDotsLabs/watermill/message", false},
		{"internal/text", module + "/inbox", false},
		{"consumer", module + "/internal/pgtest", false},
		{"effects", module + "/internal/childproc", false},
		{"internal/childproc", module + "/effects", false},
		{"internal/redact", module + "/effects", false},
		{"effects", module + "/cmd/idem", true},
	} {
		pkgs := map[string]pkg{}
		for k, v := range base {
			pkgs[k] = v
		}
		p := pkgs[tc.pkg]
		if tc.test {
			p.XTestImports = append(slices.Clone(p.XTestImports), tc.imp)
		} else {
			p.Imports = append(slices.Clone(p.Imports), tc.imp)
		}
		pkgs[tc.pkg] = p
		require.NotEmpty(t, violations(pkgs), "%s importing %s", tc.pkg, tc.imp)
	}
}
