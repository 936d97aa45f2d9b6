package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"testing/fstest"

	"github.com/stretchr/testify/require"
)

// repoRoot is the repository's root, from this package's folder.
const repoRoot = "../../../.."

var (
	srcDir   = filepath.Join(repoRoot, SourceDir)
	gooseDir = filepath.Join(repoRoot, GooseDir)
)

// generatedLine is the first line of a generated file, as Go's tools recognise it
// (https://go.dev/s/generatedcode), in SQL's comment syntax.
var generatedLine = regexp.MustCompile(`^-- Code generated .* DO NOT EDIT\.$`)

// TestGooseFilesAreCurrent fails when the goose directory does not hold exactly
// what goosegen makes from the up and down files now, or when a goose file does
// not say on its first line that it is generated.
func TestGooseFilesAreCurrent(t *testing.T) {
	t.Parallel()
	files, err := Generate(os.DirFS(srcDir))
	require.NoError(t, err)
	fix := GooseDir + " is stale: run `" + Regenerate + "` and commit the result"
	want := map[string]bool{}
	for _, f := range files {
		want[f.Name] = true
		have, err := os.ReadFile(filepath.Join(gooseDir, f.Name))
		require.NoError(t, err, "%s is missing; %s", f.Name, fix)
		require.Equal(t, string(f.Body), string(have), "%s differs from its up and down files; %s", f.Name, fix)
		first, _, _ := strings.Cut(string(have), "\n")
		require.Regexp(t, generatedLine, first, "%s: the first line says the file is generated", f.Name)
	}
	entries, err := os.ReadDir(gooseDir)
	require.NoError(t, err)
	for _, e := range entries {
		require.True(t, want[e.Name()], "%s matches no up/down pair; %s", e.Name(), fix)
	}
}

func TestAnnotateWrapsOnlyWhatGooseWouldCut(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, in, want string
	}{{
		name: "plain statements stay as they are",
		in:   "-- a comment; with a semicolon\nCREATE TABLE t (a int);\n\nCREATE INDEX i ON t (a)\n    WHERE a > 0;\n",
		want: "-- a comment; with a semicolon\nCREATE TABLE t (a int);\n\nCREATE INDEX i ON t (a)\n    WHERE a > 0;\n",
	}, {
		name: "a function body is one statement",
		in:   "CREATE FUNCTION f() RETURNS trigger\nLANGUAGE plpgsql AS $$\nBEGIN\n    RETURN NULL;\nEND;\n$$;\nSELECT 1;\n",
		want: "-- +goose StatementBegin\nCREATE FUNCTION f() RETURNS trigger\nLANGUAGE plpgsql AS $$\nBEGIN\n    RETURN NULL;\nEND;\n$$;\n-- +goose StatementEnd\nSELECT 1;\n",
	}, {
		name: "a tagged dollar quote holding $$",
		in:   "DO $body$\nBEGIN\n    PERFORM '$$;';\nEND\n$body$;\n",
		want: "-- +goose StatementBegin\nDO $body$\nBEGIN\n    PERFORM '$$;';\nEND\n$body$;\n-- +goose StatementEnd\n",
	}, {
		name: "a semicolon in a string",
		in:   "INSERT INTO t VALUES ('a;b');\n",
		want: "-- +goose StatementBegin\nINSERT INTO t VALUES ('a;b');\n-- +goose StatementEnd\n",
	}, {
		name: "a semicolon in a quoted identifier",
		in:   "CREATE TABLE \"a;b\" (x int);\n",
		want: "-- +goose StatementBegin\nCREATE TABLE \"a;b\" (x int);\n-- +goose StatementEnd\n",
	}, {
		name: "an E string whose escaped quote hides no end",
		in:   "SELECT E'it\\'s;';\nSELECT 2;\n",
		want: "-- +goose StatementBegin\nSELECT E'it\\'s;';\n-- +goose StatementEnd\nSELECT 2;\n",
	}, {
		name: "a comment line ending with a semicolon inside a statement",
		in:   "ALTER TABLE t\n    /* drop it;\n    */ DROP COLUMN a;\n",
		want: "-- +goose StatementBegin\nALTER TABLE t\n    /* drop it;\n    */ DROP COLUMN a;\n-- +goose StatementEnd\n",
	}, {
		name: "a -- comment inside a statement is fine as it is",
		in:   "ALTER TABLE t\n    -- the body; or not\n    ADD COLUMN b int; -- done;\n",
		want: "ALTER TABLE t\n    -- the body; or not\n    ADD COLUMN b int; -- done;\n",
	}, {
		name: "a positional parameter is not a dollar quote",
		in:   "PREPARE p AS SELECT $1;\nSELECT 1;\n",
		want: "PREPARE p AS SELECT $1;\nSELECT 1;\n",
	}, {
		name: "nested block comments end nothing",
		in:   "SELECT /* a /* b; */ c; */ 1;\n",
		want: "SELECT /* a /* b; */ c; */ 1;\n",
	}} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := annotate(tc.in)
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

func TestAnnotateRefusesWhatGooseCannotRead(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"SELECT 1; SELECT 2;\n":                    "on lines of its own",
		"SELECT 1;\nSELECT 2\n":                    "has no ';'",
		"-- see +goose docs\nSELECT 1;\n":          "annotation",
		"DO $$ BEGIN NULL; END\n":                  "not closed",
		"SELECT 'open;\n":                          "not closed",
		";\n":                                      "empty statement",
		"SELECT 1; /* trailing */\n":               "on lines of its own",
		"SELECT 1;\n/* stray */\n":                 "outside every statement",
		"CREATE TABLE x (a int /* unclosed );\n":   "not closed",
		"SELECT 1;\n    -- +goose StatementEnd\n":  "annotation",
		"SELECT \"unclosed;\n":                     "not closed",
		"SELECT 1 -- no semicolon at all;\n":       "has no ';'",
		"SELECT 1;\n\nSELECT 2; SELECT 3; -- no\n": "on lines of its own",
	} {
		_, err := annotate(in)
		require.ErrorContains(t, err, want, "input %q", in)
	}
}

func TestGenerateHandlesAnyNumberOfVersions(t *testing.T) {
	t.Parallel()
	fsys := fstest.MapFS{}
	for _, p := range []string{"001_a", "002_b", "003_c", "004_d", "010_j"} {
		fsys[p+".up.sql"] = &fstest.MapFile{Data: []byte("CREATE TABLE " + p + " (x int);\n")}
		fsys[p+".down.sql"] = &fstest.MapFile{Data: []byte("DROP TABLE " + p + ";")}
	}
	fsys["goose"] = &fstest.MapFile{Mode: os.ModeDir} // the output directory is skipped
	files, err := Generate(fsys)
	require.NoError(t, err)
	var names []string
	for _, f := range files {
		names = append(names, f.Name)
	}
	require.Equal(t, []string{"001_a.sql", "002_b.sql", "003_c.sql", "004_d.sql", "010_j.sql"}, names)
	require.Equal(t, headerPrefix+`from 004_d.up.sql and 004_d.down.sql. DO NOT EDIT.
-- Edit those two files, then run: `+Regenerate+`
--
-- idem migration 004_d for goose. Apply it with the target schema first in
-- search_path: each "/* schema */" marker is only a comment here.

-- +goose Up
CREATE TABLE 004_d (x int);

-- +goose Down
DROP TABLE 004_d;
`, string(files[3].Body))

	again, err := Generate(fsys)
	require.NoError(t, err)
	require.Equal(t, files, again, "the output depends only on the input")

	bad := fstest.MapFS{"001_a.up.sql": &fstest.MapFile{Data: []byte("SELECT 1;\n")}}
	_, err = Generate(bad)
	require.ErrorContains(t, err, "lacks its up or down file")
	bad["001_b.down.sql"] = &fstest.MapFile{Data: []byte("SELECT 1;\n")}
	_, err = Generate(bad)
	require.ErrorContains(t, err, "two names")
	_, err = Generate(fstest.MapFS{"1_core.sql": &fstest.MapFile{}})
	require.ErrorContains(t, err, "is not named")
}

func TestRunRewritesAndPrunesOnlyItsOwnFiles(t *testing.T) {
	t.Parallel()
	src, dst := t.TempDir(), filepath.Join(t.TempDir(), "goose")
	write := func(dir, name, body string) {
		t.Helper()
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644))
	}
	write(src, "001_a.up.sql", "SELECT 1;\n")
	write(src, "001_a.down.sql", "SELECT 2;\n")
	write(src, "002_b.up.sql", "SELECT 3;\n")
	write(src, "002_b.down.sql", "SELECT 4;\n")
	require.NoError(t, run(src, dst))
	first, err := os.ReadFile(filepath.Join(dst, "002_b.sql"))
	require.NoError(t, err)

	// 002 goes away: its generated file goes with it, and a second run of the
	// same input changes nothing.
	require.NoError(t, os.Remove(filepath.Join(src, "002_b.up.sql")))
	require.NoError(t, os.Remove(filepath.Join(src, "002_b.down.sql")))
	require.NoError(t, run(src, dst))
	require.NoFileExists(t, filepath.Join(dst, "002_b.sql"))
	require.FileExists(t, filepath.Join(dst, "001_a.sql"))
	require.True(t, strings.HasPrefix(string(first), headerPrefix))

	// A file goosegen did not write is never deleted: run stops and says so.
	write(dst, "099_mine.sql", "-- +goose Up\nSELECT 1;\n")
	require.ErrorContains(t, run(src, dst), "not a file goosegen wrote")
	require.FileExists(t, filepath.Join(dst, "099_mine.sql"))
}
