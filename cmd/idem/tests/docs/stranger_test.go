package docs

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	mdast "github.com/yuin/goldmark/ast"

	"github.com/idemkit/idem/internal/pgtest"
)

// openingDir holds every page's opening program, one package main a page:
// examples/docs/<page>/main.go.
const openingDir = "examples/docs/"

// opening is a page's opening program as a reader sees it: the text of the
// page's first Go block, and of the first text block after it (what the program
// prints).
type opening struct {
	page, source, program, prints string
}

// openings returns the opening program of every page that shows Go. A page
// whose first Go block is not a whole file under examples/docs/, or that does
// not say in a text block after it what the program prints, fails the test.
func openings(t *testing.T) []opening {
	t.Helper()
	var out []opening
	for _, page := range pages(t) {
		src, doc := parse(t, page)
		var o *opening
		require.NoError(t, mdast.Walk(doc, func(n mdast.Node, entering bool) (mdast.WalkStatus, error) {
			block, ok := n.(*mdast.FencedCodeBlock)
			if !entering || !ok {
				return mdast.WalkContinue, nil
			}
			switch lang := string(block.Language(src)); {
			case o == nil && lang == "go":
				_, arg := markerBefore(src, block)
				path, sel, _ := strings.Cut(arg, " ")
				if !strings.HasPrefix(path, openingDir) || strings.TrimSpace(sel) != "" {
					t.Errorf("%s:%d: the page's first Go block shows %q; a page opens with a whole program, <!-- snippet: %s<page>/main.go -->", page, lineOf(src, block), arg, openingDir)
					return mdast.WalkStop, nil
				}
				_, _, text := blockText(src, block)
				o = &opening{page: page, source: path, program: text}
			case o != nil && lang == "text":
				_, _, o.prints = blockText(src, block)
				return mdast.WalkStop, nil
			}
			return mdast.WalkContinue, nil
		}))
		switch {
		case o == nil:
		case o.prints == "":
			t.Errorf("%s: the opening program (%s) needs a ```text block after it that says what it prints", page, o.source)
		default:
			out = append(out, *o)
		}
	}
	return out
}

// TestOpeningProgramsRunInABlankModule reads the docs as a stranger does. For
// every page that shows Go, it copies the page's opening program (the first Go
// block, as the page shows it) into a fresh module outside the repository, whose
// go.mod has nothing but a replace to this checkout for idem and its adapter
// modules; runs go mod tidy and go build there; runs the program against the
// services of scripts/services (DATABASE_URL, KAFKA_BROKERS, NATS_URL, PGBOUNCER_URL, and
// IDEM_CITUS_URL of start citus) with a timeout; and checks that it prints what the page's text block after the
// program says. It never skips: without the services it fails saying how to
// start them.
//
// The modules come from the usual GOMODCACHE and the builds share GOCACHE, so a
// page costs one tidy, one build and one run; pages run in parallel (as many as
// -parallel, GOMAXPROCS by default). Measured on a shared 2-core machine with
// warm caches and a load average of 10 to 13: 44 s for the fourteen pages
// (README.md and thirteen pages of docs/, thirteen programs: README.md's is
// kafka.md's), 34 s of CPU; 66 s in a run where README.md and kafka.md each
// ran their own copy.
func TestOpeningProgramsRunInABlankModule(t *testing.T) {
	var missing []string
	for _, v := range []string{"DATABASE_URL", "KAFKA_BROKERS", "NATS_URL", "PGBOUNCER_URL", pgtest.CitusURLVar} {
		if os.Getenv(v) == "" {
			missing = append(missing, v)
		}
	}
	if len(missing) > 0 {
		t.Fatalf("%s unset: the opening programs run against the services; start them with eval \"$(scripts/services start)\" and eval \"$(scripts/services start citus)\" from the repository's root and run the test again", strings.Join(missing, ", "))
	}
	root, err := filepath.Abs(repoRoot)
	require.NoError(t, err)
	goBin, err := exec.LookPath("go")
	require.NoError(t, err)
	// Pages that open with the same program (README.md and kafka.md) share one
	// run: two copies at once would share a consumer group and split its
	// messages. Each page's program text and output are still checked.
	bySource := map[string][]opening{}
	var order []opening
	for _, o := range openings(t) {
		if len(bySource[o.source]) == 0 {
			order = append(order, o)
		} else {
			require.Equal(t, bySource[o.source][0].program, o.program, "%s and %s show %s differently", bySource[o.source][0].page, o.page, o.source)
		}
		bySource[o.source] = append(bySource[o.source], o)
	}
	for _, o := range order {
		t.Run(o.page, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			name := strings.TrimSuffix(filepath.Base(filepath.Dir(o.source)), "/")
			gomod := fmt.Sprintf("module example.com/%s\n\ngo 1.26.0\n\nreplace (\n"+
				"\tgithub.com/idemkit/idem => %s\n"+
				"\tgithub.com/idemkit/idem/adapters/kafka => %s\n"+
				"\tgithub.com/idemkit/idem/adapters/nats => %s\n)\n",
				name, root, filepath.Join(root, "adapters", "kafka"), filepath.Join(root, "adapters", "nats"))
			require.NoError(t, os.WriteFile(filepath.Join(dir, "go.mod"), []byte(gomod), 0o644))
			require.NoError(t, os.WriteFile(filepath.Join(dir, "main.go"), []byte(o.program), 0o644))

			env := append(os.Environ(), "GOWORK=off", "GOFLAGS=-mod=mod")
			run := func(timeout time.Duration, name string, args ...string) string {
				ctx, cancel := context.WithTimeout(context.Background(), timeout)
				defer cancel()
				cmd := exec.CommandContext(ctx, name, args...)
				cmd.Dir, cmd.Env = dir, env
				var stdout, stderr bytes.Buffer
				cmd.Stdout, cmd.Stderr = &stdout, &stderr
				if err := cmd.Run(); err != nil {
					t.Fatalf("%s (the opening program of %s, from %s): %s %s: %v\n%s%s", o.page, o.page, o.source, name, strings.Join(args, " "), err, stdout.String(), stderr.String())
				}
				return stdout.String()
			}
			run(3*time.Minute, goBin, "mod", "tidy")
			run(3*time.Minute, goBin, "build", "-o", "program", ".")
			if strings.Contains(o.program, pgtest.CitusURLVar) {
				// A program on the Citus cluster distributes its tables: it runs
				// under the locks the Citus tests of every package take, so that no
				// worker crashes and no other DDL meets its own meanwhile.
				pgtest.Citus(t)
				defer pgtest.CitusDDL(t)()
			}
			got := run(2*time.Minute, filepath.Join(dir, "program"))
			for _, same := range bySource[o.source] {
				require.Equal(t, same.prints, got, "%s: what its opening program (%s) prints, run in a blank module", same.page, o.source)
			}
		})
	}
}
