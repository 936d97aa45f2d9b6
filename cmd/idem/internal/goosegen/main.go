// Command goosegen writes goose's form of idem's migrations: for each version of
// NNN_name.{up,down}.sql in SourceDir, one NNN_name.sql in GooseDir (both named in
// gen.go, from the repository's root) with "-- +goose Up" and "-- +goose Down"
// sections, and "-- +goose StatementBegin" / "StatementEnd" around every statement
// that holds a semicolon of its own (a DO block, a function body), which goose
// would otherwise cut in two.
//
// The up and down files stay the single source: idem's Migrator and golang-migrate
// read them as they are. The goose files are generated from them, byte for byte
// the same SQL plus the annotations, so the two can never disagree. Run it with
// the go:generate line beside the migrations' embed (Regenerate in gen.go).
//
// The output depends only on the source files (no time, no paths), so a second run
// changes nothing; a test fails when the goose files are stale. It deletes a .sql
// file in the goose directory only when it is one it generated (it starts with the
// generated-code header) and no source version produces it any more.
package main

import (
	"bytes"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

func main() {
	src := flag.String("src", "migrations", "directory of the NNN_name.up.sql and NNN_name.down.sql files")
	dst := flag.String("dst", "migrations/goose", "directory to write the goose files to")
	flag.Parse()
	if err := run(*src, *dst); err != nil {
		fmt.Fprintln(os.Stderr, "goosegen:", err)
		os.Exit(1)
	}
}

func run(src, dst string) error {
	files, err := Generate(os.DirFS(src))
	if err != nil {
		return fmt.Errorf("%s: %w", src, err)
	}
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return err
	}
	want := map[string]bool{}
	for _, f := range files {
		want[f.Name] = true
		path := filepath.Join(dst, f.Name)
		if old, err := os.ReadFile(path); err == nil && bytes.Equal(old, f.Body) {
			continue
		}
		if err := os.WriteFile(path, f.Body, 0o644); err != nil {
			return err
		}
	}
	entries, err := os.ReadDir(dst)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if e.IsDir() || want[e.Name()] || !strings.HasSuffix(e.Name(), ".sql") {
			continue
		}
		path := filepath.Join(dst, e.Name())
		body, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		if !bytes.HasPrefix(body, []byte(headerPrefix)) {
			return fmt.Errorf("%s is not a file goosegen wrote, and no migration produces it: move it away by hand", path)
		}
		if err := os.Remove(path); err != nil {
			return err
		}
	}
	return nil
}

// File is one generated goose migration.
type File struct {
	Name string // NNN_name.sql
	Body []byte
}
