package docs

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	mdast "github.com/yuin/goldmark/ast"
)

// TestFAQHasEveryErrorCode finds every stable error code in the library's Go
// sources (errcode.Permanent and errcode.Transient's first argument, the Code*
// constants, and the "permanent" code of an uncoded permanent failure) and checks
// that docs/faq.md has a level-3 heading naming it in a code span.
func TestFAQHasEveryErrorCode(t *testing.T) {
	codes := map[string]string{"permanent": "consumer"}
	fset := token.NewFileSet()
	require.NoError(t, filepath.WalkDir(repoRoot, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(repoRoot, path)
		if d.IsDir() {
			switch filepath.ToSlash(rel) {
			case ".git", "cmd", "examples", "internal/pgtest":
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, 0)
		if err != nil {
			return err
		}
		ast.Inspect(f, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.CallExpr:
				sel, ok := n.Fun.(*ast.SelectorExpr)
				if !ok || len(n.Args) == 0 {
					return true
				}
				pkg, ok := sel.X.(*ast.Ident)
				if !ok || pkg.Name != "errcode" || (sel.Sel.Name != "Permanent" && sel.Sel.Name != "Transient") {
					return true
				}
				if lit, ok := n.Args[0].(*ast.BasicLit); ok && lit.Kind == token.STRING {
					code, _ := strconv.Unquote(lit.Value)
					codes[code] = rel
				}
			case *ast.ValueSpec:
				for i, name := range n.Names {
					if !strings.HasPrefix(name.Name, "Code") || i >= len(n.Values) {
						continue
					}
					if lit, ok := n.Values[i].(*ast.BasicLit); ok && lit.Kind == token.STRING {
						code, _ := strconv.Unquote(lit.Value)
						codes[code] = rel
					}
				}
			}
			return true
		})
		return nil
	}))
	require.Greater(t, len(codes), 40, "the scan finds the codes")

	src, doc := parse(t, "docs/faq.md")
	documented := map[string]bool{}
	require.NoError(t, mdast.Walk(doc, func(n mdast.Node, entering bool) (mdast.WalkStatus, error) {
		if h, ok := n.(*mdast.Heading); entering && ok && h.Level == 3 {
			for c := h.FirstChild(); c != nil; c = c.NextSibling() {
				if cs, ok := c.(*mdast.CodeSpan); ok {
					documented[plainText(src, cs)] = true
				}
			}
		}
		return mdast.WalkContinue, nil
	}))
	var missing []string
	for code, file := range codes {
		if !documented[code] {
			missing = append(missing, code+" ("+filepath.ToSlash(file)+")")
		}
	}
	sort.Strings(missing)
	require.Empty(t, missing, "docs/faq.md has no ### `code` entry for these codes")
}
