package importrules_test

import (
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// mapPage is the page whose tables say what each package imports, relative to
// the repository's root.
const mapPage = "docs/architecture/packages.md"

// row is one package's row in the page's import tables.
type row struct {
	line    int // 1-based
	imports []string
}

var braces = regexp.MustCompile(`([\w./-]*)\{([^}]*)\}`)

// readMap parses the tables of the section "Packages and imports": a row is
// "| `package` | imports of idem | ... |", the imports separated by commas, with
// "prefix/{a, b}" for "prefix/a, prefix/b".
func readMap(page string) (map[string]row, error) {
	rows := map[string]row{}
	in := false
	for i, line := range strings.Split(page, "\n") {
		if strings.HasPrefix(line, "## ") {
			in = line == "## Packages and imports"
			continue
		}
		if !in || !strings.HasPrefix(line, "| `") {
			continue
		}
		cells := strings.Split(line, "|")
		if len(cells) < 4 {
			return nil, fmt.Errorf("%s:%d: a row needs a package and its imports of idem", mapPage, i+1)
		}
		name := strings.Trim(strings.TrimSpace(cells[1]), "`")
		if _, dup := rows[name]; dup {
			return nil, fmt.Errorf("%s:%d: a second row for %s", mapPage, i+1, name)
		}
		cell := braces.ReplaceAllStringFunc(cells[2], func(m string) string {
			sub := braces.FindStringSubmatch(m)
			var out []string
			for _, leaf := range strings.Split(sub[2], ",") {
				out = append(out, sub[1]+strings.TrimSpace(leaf))
			}
			return strings.Join(out, ", ")
		})
		var imports []string
		for _, imp := range strings.Split(cell, ",") {
			if imp = strings.TrimSpace(imp); imp != "" {
				imports = append(imports, imp)
			}
		}
		slices.Sort(imports)
		rows[name] = row{line: i + 1, imports: imports}
	}
	if len(rows) == 0 {
		return nil, fmt.Errorf("%s: no table rows in the section \"Packages and imports\"", mapPage)
	}
	return rows, nil
}

// actualImports is what a package's row should list: the idem packages its
// non-test files import, or, for a package of tests only (no Go file but doc.go
// outside its tests), those its tests import.
func actualImports(name string, p pkg) []string {
	imports := idem(p.Imports)
	if len(p.GoFiles) == 0 || slices.Equal(p.GoFiles, []string{"doc.go"}) {
		imports = append(imports, idem(slices.Concat(p.TestImports, p.XTestImports))...)
	}
	slices.Sort(imports)
	imports = slices.Compact(imports)
	return slices.DeleteFunc(imports, func(imp string) bool { return imp == name })
}

// mapDiff compares the page's import tables with pkgs and says which row to fix.
// The examples' module has no rows.
func mapDiff(page string, pkgs map[string]pkg) []string {
	rows, err := readMap(page)
	if err != nil {
		return []string{err.Error()}
	}
	var bad []string
	for name, p := range pkgs {
		if name == "examples" || strings.HasPrefix(name, "examples/") {
			continue
		}
		want := actualImports(name, p)
		r, ok := rows[name]
		if !ok {
			bad = append(bad, fmt.Sprintf("%s: no row for `%s`; add one that imports: %s", mapPage, name, strings.Join(want, ", ")))
			continue
		}
		var add, drop []string
		for _, imp := range want {
			if !slices.Contains(r.imports, imp) {
				add = append(add, imp)
			}
		}
		for _, imp := range r.imports {
			if !slices.Contains(want, imp) {
				drop = append(drop, imp)
			}
		}
		if len(add) > 0 || len(drop) > 0 {
			msg := fmt.Sprintf("%s:%d: the row of `%s` does not match go list:", mapPage, r.line, name)
			if len(add) > 0 {
				msg += " add " + strings.Join(add, ", ") + ";"
			}
			if len(drop) > 0 {
				msg += " remove " + strings.Join(drop, ", ") + ";"
			}
			bad = append(bad, msg)
		}
	}
	for name, r := range rows {
		if _, ok := pkgs[name]; !ok {
			bad = append(bad, fmt.Sprintf("%s:%d: `%s` is not a package: remove its row", mapPage, r.line, name))
		}
	}
	slices.Sort(bad)
	return bad
}

func readPage(t *testing.T) string {
	t.Helper()
	page, err := os.ReadFile("../../" + mapPage)
	require.NoError(t, err)
	return string(page)
}

// TestImportMapMatchesGoList: each row of the page's import tables lists the idem
// packages that package imports, no more and no less, and every package has a row.
func TestImportMapMatchesGoList(t *testing.T) {
	t.Parallel()
	pkgs := listPackages(t)
	require.Contains(t, pkgs, "cmd/idem", "go list, run in the workspace of go.work, lists the tools' packages too")
	if bad := mapDiff(readPage(t), pkgs); len(bad) > 0 {
		t.Fatalf("the import map differs from go list:\n%s", strings.Join(bad, "\n"))
	}
}

// TestImportMapCatchesDrift: a wrong edge, a missing edge, a missing row and a row
// for no package each fail, naming the line to fix (whether or not the page
// matches go list as it is).
func TestImportMapCatchesDrift(t *testing.T) {
	t.Parallel()
	pkgs := listPackages(t)
	page := readPage(t)
	rows, err := readMap(page)
	require.NoError(t, err)
	lines := strings.Split(page, "\n")
	edit := func(line int, f func(string) string) string {
		out := slices.Clone(lines)
		out[line-1] = f(out[line-1])
		return strings.Join(out, "\n")
	}
	shard := rows["shard"].line
	for _, tc := range []struct {
		name, page, want string
	}{
		{"wrong edge", edit(shard, func(l string) string {
			return strings.Replace(l, "internal/{errcode, pgschema}", "internal/{errcode, pgschema, text}", 1)
		}), fmt.Sprintf("%s:%d: the row of `shard` does not match go list: remove internal/text;", mapPage, shard)},
		{"missing edge", edit(shard, func(l string) string {
			return strings.Replace(l, "internal/{errcode, pgschema}", "internal/errcode", 1)
		}), fmt.Sprintf("%s:%d: the row of `shard` does not match go list: add internal/pgschema;", mapPage, shard)},
		{"missing row", edit(shard, func(string) string { return "" }),
			mapPage + ": no row for `shard`; add one that imports: internal/errcode, internal/pgschema"},
		{"row for no package", edit(shard, func(l string) string { return l + "\n| `shards` | internal/errcode | | |" }),
			fmt.Sprintf("%s:%d: `shards` is not a package: remove its row", mapPage, shard+1)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.NotEqual(t, page, tc.page, "the edit changed the page")
			require.NotContains(t, mapDiff(page, pkgs), tc.want)
			require.Contains(t, mapDiff(tc.page, pkgs), tc.want)
		})
	}
}

// layoutPage is the page whose "Layout" table names every package.
const layoutPage = "docs/architecture/README.md"

var quoted = regexp.MustCompile("`([^`]+)`")

// layoutNames are the names in backquotes in the first cell of each row of the
// page's "Layout" table, without a trailing slash.
func layoutNames(page string) map[string]bool {
	names := map[string]bool{}
	in := false
	for _, line := range strings.Split(page, "\n") {
		if strings.HasPrefix(line, "## ") {
			in = line == "## Layout"
			continue
		}
		if !in || !strings.HasPrefix(line, "| `") {
			continue
		}
		first := strings.Split(line, "|")[1]
		for _, m := range quoted.FindAllStringSubmatch(first, -1) {
			names[strings.TrimSuffix(m[1], "/")] = true
		}
	}
	return names
}

// TestLayoutNamesEveryPackage: the architecture's layout table has a row for every
// package of the library and the tools (the examples' module is one row).
func TestLayoutNamesEveryPackage(t *testing.T) {
	t.Parallel()
	page, err := os.ReadFile("../../" + layoutPage)
	require.NoError(t, err)
	names := layoutNames(string(page))
	require.True(t, names["examples"], "%s: the layout table names examples/", layoutPage)
	var missing []string
	for name := range listPackages(t) {
		if name != "examples" && !strings.HasPrefix(name, "examples/") && !names[name] {
			missing = append(missing, name)
		}
	}
	slices.Sort(missing)
	require.Empty(t, missing, "%s: the layout table has no row for these packages", layoutPage)
	var stale []string
	for name := range names {
		if _, err := os.Stat("../../" + name); err != nil {
			stale = append(stale, name)
		}
	}
	slices.Sort(stale)
	require.Empty(t, stale, "%s: the layout table names folders that do not exist", layoutPage)
}
