package docs

import (
	"bytes"
	"flag"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"unicode"

	"github.com/stretchr/testify/require"
	"github.com/yuin/goldmark"
	mdast "github.com/yuin/goldmark/ast"
	"github.com/yuin/goldmark/extension"

	"github.com/yuin/goldmark/text"
)

// repoRoot is the repository's root, from this package's folder.
const repoRoot = "../../../.."

var update = flag.Bool("update", false, "rewrite every snippet in the pages from its Go source")

// markdown parses as GitHub does for what these tests read: CommonMark with
// GitHub's tables (a table cell's links are links).
var markdown = goldmark.New(goldmark.WithExtensions(extension.GFM)).Parser()

// pages are README.md and every .md file under docs/, relative to repoRoot.
func pages(t *testing.T) []string {
	t.Helper()
	out := []string{"README.md"}
	require.NoError(t, filepath.WalkDir(filepath.Join(repoRoot, "docs"), func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && strings.HasSuffix(path, ".md") {
			rel, err := filepath.Rel(repoRoot, path)
			if err != nil {
				return err
			}
			out = append(out, filepath.ToSlash(rel))
		}
		return nil
	}))
	return out
}

func parse(t *testing.T, page string) ([]byte, mdast.Node) {
	t.Helper()
	src, err := os.ReadFile(filepath.Join(repoRoot, page))
	require.NoError(t, err)
	return src, markdown.Parse(text.NewReader(src))
}

// marker reads the HTML comment right before a fenced block.
var marker = regexp.MustCompile(`^<!--\s*(snippet|fragment):\s*(.*?)\s*-->\s*$`)

// TestGoSnippetsMatchTheirSources checks every fenced Go block of every page
// against the Go file it names; a block marked as a fragment fails, since nothing
// compiles it.
func TestGoSnippetsMatchTheirSources(t *testing.T) {
	for _, page := range pages(t) {
		t.Run(page, func(t *testing.T) {
			src, doc := parse(t, page)
			type edit struct {
				start, stop int
				text        string
			}
			var edits []edit
			err := mdast.Walk(doc, func(n mdast.Node, entering bool) (mdast.WalkStatus, error) {
				if indented, ok := n.(*mdast.CodeBlock); ok && entering && looksLikeGo(indentedText(src, indented)) {
					t.Errorf("%s:%d: an indented block of Go: make it a fenced go block with a snippet marker", page,
						bytes.Count(src[:indented.Lines().At(0).Start], []byte("\n"))+1)
					return mdast.WalkContinue, nil
				}
				block, ok := n.(*mdast.FencedCodeBlock)
				if !entering || !ok || string(block.Language(src)) != "go" {
					return mdast.WalkContinue, nil
				}
				line := lineOf(src, block)
				kind, arg := markerBefore(src, block)
				switch kind {
				case "fragment":
					t.Errorf("%s:%d: a Go block that nothing compiles (%s): show it from a Go source instead, e.g. a doc* function in the package's example_docs_test.go, with <!-- snippet: file.go body=docX -->", page, line, arg)
					return mdast.WalkContinue, nil
				case "":
					t.Errorf("%s:%d: a Go block needs <!-- snippet: file.go body=Example --> (the Go source it shows) on the line before it", page, line)
					return mdast.WalkContinue, nil
				}
				want, err := snippet(arg)
				if err != nil {
					t.Errorf("%s:%d: snippet %q: %v", page, line, arg, err)
					return mdast.WalkContinue, nil
				}
				start, stop, got := blockText(src, block)
				if got != want {
					if *update {
						edits = append(edits, edit{start, stop, indent(want, fenceIndent(src, block))})
						return mdast.WalkContinue, nil
					}
					t.Errorf("%s:%d: the block differs from %s; run go test ./tests/docs -update in cmd/idem to copy the source in\n--- page\n%s\n--- source\n%s", page, line, arg, got, want)
				}
				return mdast.WalkContinue, nil
			})
			require.NoError(t, err)
			if len(edits) > 0 {
				var out bytes.Buffer
				last := 0
				for _, e := range edits {
					out.Write(src[last:e.start])
					out.WriteString(e.text)
					last = e.stop
				}
				out.Write(src[last:])
				require.NoError(t, os.WriteFile(filepath.Join(repoRoot, page), out.Bytes(), 0o644))
				t.Logf("%s: %d snippets rewritten", page, len(edits))
			}
		})
	}
}

// looksLikeGo reports whether an indented code block is Go: it parses as Go
// statements or declarations. Shell commands, program output and SQL do not.
func looksLikeGo(code string) bool {
	if strings.TrimSpace(code) == "" {
		return false
	}
	fset := token.NewFileSet()
	if _, err := parser.ParseFile(fset, "", "package p\nfunc _() {\n"+code+"\n}\n", 0); err == nil {
		return true
	}
	_, err := parser.ParseFile(fset, "", "package p\n"+code, 0)
	return err == nil
}

func indentedText(src []byte, block *mdast.CodeBlock) string {
	var b strings.Builder
	for i := range block.Lines().Len() {
		seg := block.Lines().At(i)
		b.Write(seg.Value(src))
	}
	return b.String()
}

// markerBefore returns the snippet or fragment marker of the HTML block right
// before the fenced block, if there is one.
func markerBefore(src []byte, block *mdast.FencedCodeBlock) (kind, arg string) {
	prev, ok := block.PreviousSibling().(*mdast.HTMLBlock)
	if !ok {
		return "", ""
	}
	var b strings.Builder
	for i := range prev.Lines().Len() {
		seg := prev.Lines().At(i)
		b.Write(seg.Value(src))
	}
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	m := marker.FindStringSubmatch(strings.TrimSpace(lines[len(lines)-1]))
	if m == nil {
		return "", ""
	}
	return m[1], m[2]
}

// fenceIndent is the indentation of a fenced block's opening line (a block in a
// list item is indented to the item's content), which its content lines repeat.
func fenceIndent(src []byte, block *mdast.FencedCodeBlock) string {
	i := block.Info.Segment.Start
	for i > 0 && src[i-1] != '\n' {
		i--
	}
	j := i
	for j < len(src) && (src[j] == ' ' || src[j] == '\t') {
		j++
	}
	return string(src[i:j])
}

// indent prefixes every non-empty line of text with prefix.
func indent(text, prefix string) string {
	if prefix == "" {
		return text
	}
	lines := strings.SplitAfter(text, "\n")
	for i, l := range lines {
		if strings.TrimSpace(l) != "" {
			lines[i] = prefix + l
		}
	}
	return strings.Join(lines, "")
}

// blockText returns a fenced block's content and its byte range in src.
func blockText(src []byte, block *mdast.FencedCodeBlock) (start, stop int, content string) {
	lines := block.Lines()
	if lines.Len() == 0 {
		// An empty block: its content would go right after the opening fence.
		i := block.Info.Segment.Stop
		for i < len(src) && src[i] != '\n' {
			i++
		}
		return i + 1, i + 1, ""
	}
	var b strings.Builder
	for i := range lines.Len() {
		seg := lines.At(i)
		b.Write(seg.Value(src))
	}
	start = lines.At(0).Start
	for start > 0 && src[start-1] != '\n' {
		start-- // the whole first line, with its indentation
	}
	return start, lines.At(lines.Len() - 1).Stop, b.String()
}

func lineOf(src []byte, block *mdast.FencedCodeBlock) int {
	if block.Info != nil {
		return bytes.Count(src[:block.Info.Segment.Start], []byte("\n")) + 1
	}
	if block.Lines().Len() > 0 {
		return bytes.Count(src[:block.Lines().At(0).Start], []byte("\n"))
	}
	return 0
}

// snippet returns the text a marker names: "path", "path body=F" or
// "path decl=A,T.M".
func snippet(arg string) (string, error) {
	path, sel, _ := strings.Cut(arg, " ")
	file := filepath.Join(repoRoot, filepath.FromSlash(path))
	src, err := os.ReadFile(file)
	if err != nil {
		return "", err
	}
	sel = strings.TrimSpace(sel)
	if sel == "" {
		return string(src), nil
	}
	what, names, ok := strings.Cut(sel, "=")
	if !ok || (what != "body" && what != "decl") {
		return "", fmt.Errorf("the selector is body=Func or decl=Name,Type.Method, not %q", sel)
	}
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, file, src, parser.ParseComments)
	if err != nil {
		return "", err
	}
	var parts []string
	for _, name := range strings.Split(names, ",") {
		decl := findDecl(f, name)
		if decl == nil {
			return "", fmt.Errorf("%s declares no %s", path, name)
		}
		if what == "body" {
			fn, ok := decl.(*ast.FuncDecl)
			if !ok || fn.Body == nil {
				return "", fmt.Errorf("%s is not a function with a body", name)
			}
			lb, rb := fset.Position(fn.Body.Lbrace).Offset, fset.Position(fn.Body.Rbrace).Offset
			body := strings.TrimPrefix(string(src[lb+1:rb]), "\n")
			var out []string
			for _, l := range strings.SplitAfter(body, "\n") {
				out = append(out, strings.TrimPrefix(l, "\t"))
			}
			parts = append(parts, strings.Join(out, ""))
			continue
		}
		start := decl.Pos()
		if doc := docOf(decl); doc != nil {
			start = doc.Pos()
		}
		parts = append(parts, string(src[fset.Position(start).Offset:fset.Position(decl.End()).Offset])+"\n")
	}
	return strings.Join(parts, "\n"), nil
}

func findDecl(f *ast.File, name string) ast.Decl {
	recv, fn, method := strings.Cut(name, ".")
	if !method {
		fn, recv = recv, ""
	}
	for _, d := range f.Decls {
		switch d := d.(type) {
		case *ast.FuncDecl:
			if d.Name.Name != fn {
				continue
			}
			if recv == "" && d.Recv == nil {
				return d
			}
			if recv != "" && d.Recv != nil && len(d.Recv.List) == 1 && typeName(d.Recv.List[0].Type) == recv {
				return d
			}
		case *ast.GenDecl:
			for _, s := range d.Specs {
				if ts, ok := s.(*ast.TypeSpec); ok && ts.Name.Name == name && !method {
					return d
				}
			}
		}
	}
	return nil
}

func typeName(e ast.Expr) string {
	switch e := e.(type) {
	case *ast.StarExpr:
		return typeName(e.X)
	case *ast.Ident:
		return e.Name
	}
	return ""
}

func docOf(d ast.Decl) *ast.CommentGroup {
	switch d := d.(type) {
	case *ast.FuncDecl:
		return d.Doc
	case *ast.GenDecl:
		return d.Doc
	}
	return nil
}

// TestLinksResolve checks every link of every page, and of the examples'
// READMEs, that is not a URL with a scheme: the file or folder it names exists, and its #anchor is a heading of
// the target page under GitHub's rules.
func TestLinksResolve(t *testing.T) {
	anchors := map[string][]string{}
	anchorsOf := func(page string) []string {
		if a, ok := anchors[page]; ok {
			return a
		}
		src, doc := parse(t, page)
		anchors[page] = headingAnchors(src, doc)
		return anchors[page]
	}
	examples, err := filepath.Glob(filepath.Join(repoRoot, "examples", "*", "README.md"))
	require.NoError(t, err)
	all := pages(t)
	for _, e := range examples {
		rel, err := filepath.Rel(repoRoot, e)
		require.NoError(t, err)
		all = append(all, filepath.ToSlash(rel))
	}
	for _, page := range all {
		t.Run(page, func(t *testing.T) {
			_, doc := parse(t, page)
			require.NoError(t, mdast.Walk(doc, func(n mdast.Node, entering bool) (mdast.WalkStatus, error) {
				var dest string
				switch n := n.(type) {
				case *mdast.Link:
					dest = string(n.Destination)
				case *mdast.Image:
					dest = string(n.Destination)
				default:
					return mdast.WalkContinue, nil
				}
				if !entering {
					return mdast.WalkContinue, nil
				}
				u, err := url.Parse(dest)
				if err != nil {
					t.Errorf("%s: link %q: %v", page, dest, err)
					return mdast.WalkContinue, nil
				}
				if u.Scheme != "" || u.Host != "" {
					return mdast.WalkContinue, nil
				}
				target := page
				if u.Path != "" {
					target = filepath.ToSlash(filepath.Join(filepath.Dir(page), u.Path))
					if _, err := os.Stat(filepath.Join(repoRoot, target)); err != nil {
						t.Errorf("%s: link %q: %s does not exist", page, dest, target)
						return mdast.WalkContinue, nil
					}
				}
				if u.Fragment != "" && strings.HasSuffix(target, ".md") {
					if !slices.Contains(anchorsOf(target), u.Fragment) {
						t.Errorf("%s: link %q: %s has no heading with anchor #%s", page, dest, target, u.Fragment)
					}
				}
				return mdast.WalkContinue, nil
			}))
		})
	}
}

// headingAnchors are the anchors GitHub gives a page's headings: the heading's
// text, lower-cased, without punctuation other than '-' and '_', spaces turned
// into '-', and a second heading with the same anchor suffixed -1, a third -2.
func headingAnchors(src []byte, doc mdast.Node) []string {
	var out []string
	seen := map[string]int{}
	_ = mdast.Walk(doc, func(n mdast.Node, entering bool) (mdast.WalkStatus, error) {
		h, ok := n.(*mdast.Heading)
		if !entering || !ok {
			return mdast.WalkContinue, nil
		}
		a := slug(plainText(src, h))
		if k := seen[a]; k > 0 {
			out = append(out, fmt.Sprintf("%s-%d", a, k))
		} else {
			out = append(out, a)
		}
		seen[a]++
		return mdast.WalkSkipChildren, nil
	})
	return out
}

func plainText(src []byte, n mdast.Node) string {
	var b strings.Builder
	for c := n.FirstChild(); c != nil; c = c.NextSibling() {
		switch c := c.(type) {
		case *mdast.Text:
			b.Write(c.Segment.Value(src))
			if c.SoftLineBreak() || c.HardLineBreak() {
				b.WriteByte(' ')
			}
		case *mdast.String:
			b.Write(c.Value)
		default:
			b.WriteString(plainText(src, c))
		}
	}
	return b.String()
}

func slug(s string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(s) {
		switch {
		case r == ' ':
			b.WriteByte('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsNumber(r) || unicode.Is(unicode.Mn, r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

func TestSlug(t *testing.T) {
	for in, want := range map[string]string{
		"Quick start":                           "quick-start",
		"HTTP: Idempotency-Key (`httpidem`)":    "http-idempotency-key-httpidem",
		"Configuration (`consumer.Config`)":     "configuration-consumerconfig",
		"1. Make the broker misbehave":          "1-make-the-broker-misbehave",
		"What a handler may do, and must not":   "what-a-handler-may-do-and-must-not",
		"Records in flight, and the order each": "records-in-flight-and-the-order-each",
	} {
		src := []byte("# " + in + "\n")
		got := headingAnchors(src, markdown.Parse(text.NewReader(src)))
		require.Equal(t, []string{want}, got, in)
	}
}
