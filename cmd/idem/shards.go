package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/redact"
	"github.com/idemkit/idem/shard"
)

// shardSpec is one shard as the command line or the shards file names it.
type shardSpec struct {
	Name   string `json:"name"`
	URL    string `json:"url"`
	Schema string `json:"schema,omitempty"`
}

// shardsFile is the shard map's file (--shards, $IDEM_SHARDS): JSON, which the
// standard library reads strictly (an unknown field is an error, so a typo never
// passes silently) and every tool writes:
//
//	{"shards": [{"name": "s1", "url": "postgres://…", "schema": "idem"}, …],
//	 "table": {"acme": "s2"}}
//
// table routes the tenants it names over the hash, as shard.Map.Table.
type shardsFile struct {
	Shards []shardSpec       `json:"shards"`
	Table  map[string]string `json:"table,omitempty"`
}

// shardFlags is the repeated --shard name=URL[,schema=S] flag.
type shardFlags struct{ specs []shardSpec }

func (f *shardFlags) String() string {
	names := make([]string, len(f.specs))
	for i, s := range f.specs {
		names[i] = s.Name
	}
	return strings.Join(names, ",")
}

// Type names the value in --help.
func (f *shardFlags) Type() string { return "name=URL[,schema=S]" }

// Set reads name=URL, with ",schema=S" at the end if given (a URL may hold commas:
// only a last part that starts with "schema=" is the schema).
func (f *shardFlags) Set(v string) error {
	name, rest, ok := strings.Cut(v, "=")
	if !ok || name == "" || rest == "" {
		return fmt.Errorf("%q: use name=URL or name=URL,schema=SCHEMA", redact.Text(v, v))
	}
	s := shardSpec{Name: name, URL: rest}
	if i := strings.LastIndex(rest, ","); i >= 0 && strings.HasPrefix(rest[i+1:], "schema=") {
		s.URL, s.Schema = rest[:i], strings.TrimPrefix(rest[i+1:], "schema=")
	}
	f.specs = append(f.specs, s)
	return nil
}

// shardsGiven says whether the command runs over a shard map.
func (e *env) shardsGiven() bool { return len(e.shardFlags.specs) > 0 || e.shardsPath != "" }

// resolveShards reads the shard map's specs from --shard or the file; it refuses
// both at once, and --database-url or --schema beside them.
func (e *env) resolveShards() error {
	if e.shardsPath == "" && len(e.shardFlags.specs) == 0 {
		e.shardsPath = os.Getenv("IDEM_SHARDS")
		if e.shardsPath == "" || e.databaseGiven || e.schemaGiven {
			e.shardsPath = ""
			return nil
		}
	}
	switch {
	case e.shardsPath != "" && len(e.shardFlags.specs) > 0:
		return usagef("give the shards with --shard or --shards FILE, not both")
	case e.databaseGiven || e.schemaGiven:
		return usagef("--database-url and --schema name one database; with --shard or --shards each shard names its own URL and schema")
	}
	e.specs = e.shardFlags.specs
	if e.shardsPath != "" {
		b, err := os.ReadFile(e.shardsPath)
		if err != nil {
			return usagef("--shards: %v", err)
		}
		var f shardsFile
		dec := json.NewDecoder(bytes.NewReader(b))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&f); err != nil {
			return usagef("--shards %s: %v (want {\"shards\": [{\"name\": \"s1\", \"url\": \"postgres://…\", \"schema\": \"idem\"}, …], \"table\": {\"tenant\": \"s1\"}})", e.shardsPath, err)
		}
		e.specs, e.routeTable = f.Shards, f.Table
	}
	if len(e.specs) == 0 {
		return usagef("--shards %s names no shard", e.shardsPath)
	}
	for i := range e.specs {
		s := &e.specs[i]
		if s.Schema == "" {
			s.Schema = inbox.DefaultSchema
		}
		if err := pgschema.Validate(s.Schema); err != nil {
			return usagef("shard %q: schema %q is not a plain lower-case identifier (letters, digits, _; at most 63)", s.Name, s.Schema)
		}
	}
	return nil
}

// shardMap opens one pool per shard, once. The pools connect lazily: a shard that
// is down is named by the error of the first statement on it, and the others
// still answer (stats shows them).
func (e *env) shardMap(ctx context.Context) (*shard.Map, error) {
	if e.shards != nil {
		return e.shards, nil
	}
	m := &shard.Map{Table: e.routeTable}
	for _, s := range e.specs {
		cfg, err := poolConfig(s.URL)
		if err != nil {
			e.closeShards(m)
			return nil, usagef("shard %q: bad URL: %v", s.Name, redact.Error(err, s.URL))
		}
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			e.closeShards(m)
			return nil, usagef("shard %q: %v", s.Name, redact.Error(err, s.URL))
		}
		m.Shards = append(m.Shards, shard.Shard{Name: s.Name, Pool: pool, Schema: s.Schema})
	}
	if err := m.Validate(); err != nil {
		e.closeShards(m)
		return nil, usagef("shard map: %v", err)
	}
	e.shards = m
	return m, nil
}

func (e *env) closeShards(m *shard.Map) {
	if m == nil {
		return
	}
	for _, s := range m.Shards {
		s.Pool.Close()
	}
}

// where names what the command works on, for its output: "schema idem", or
// "shards s1, s2, s3".
func (e *env) where() string {
	if e.shardsGiven() {
		names := make([]string, len(e.specs))
		for i, s := range e.specs {
			names[i] = s.Name
		}
		return "shards " + strings.Join(names, ", ")
	}
	return "schema " + e.schema
}

// redactAll masks the password of every DSN the command was given in s.
func (e *env) redactAll(s string) string {
	s = redact.Text(s, e.redactDSN())
	for _, sp := range e.specs {
		s = redact.Text(s, sp.URL)
	}
	return s
}

// oneDatabase refuses a command that works on one database only under a shard map.
func (e *env) oneDatabase(what string) error {
	if e.shardsGiven() {
		return usagef("%s works on one database: give it --database-url and --schema (one shard's), not --shard or --shards", what)
	}
	return nil
}

// rowsTable is e.table with a SHARD column first over a shard map; fill it with
// shardRow.
func (e *env) rowsTable(header ...string) *tabwriter.Writer {
	if e.shardsGiven() {
		header = append([]string{"SHARD"}, header...)
	}
	return e.table(header...)
}

// shardRow writes a row of a rowsTable: the row's shard first over a shard map.
func (e *env) shardRow(tw io.Writer, shard string, cells ...any) {
	if e.shardsGiven() {
		cells = append([]any{printable(shard)}, cells...)
	}
	row(tw, cells...)
}
