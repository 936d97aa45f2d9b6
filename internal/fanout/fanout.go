// Package fanout is the one place where idem's fronts (the Consumer, the
// Dispatcher, httpidem's Middleware, the Janitor, the Migrator, the Admin) meet
// their databases. A front holds a Set: one single-database engine for each
// database, and the route from tenant to engine. One database is a Set of one
// part, which every tenant routes to without the route being asked; a shard map
// is a Set of one part a shard, in map order. A front therefore has one code
// path, whatever the number of databases: it routes a unit of work to one part,
// or runs an operation on every part (Each, Parallel) and merges what they
// return (Merge).
//
// Errors from the parts of a shard map name their shard ("shard %q: …"); the
// part of one database has no name, and its errors are returned as they are.
package fanout

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/promreg"
	"github.com/idemkit/idem/internal/schemacheck"
	"github.com/idemkit/idem/shard"
)

// Set is a front's parts: one engine a database, and the route to them.
type Set[T any] struct {
	m     *shard.Map // nil: one database, one unnamed part
	parts []T
}

// Build returns the parts of a front whose config is cfg. With m nil, cfg names
// one database and the Set has the one part build(cfg). Otherwise it has one part
// a shard of m, in map order, each build(forShard(sh)); an error says which shard
// it came from.
func Build[C, T any](m *shard.Map, cfg C, forShard func(shard.Shard) C, build func(C) (T, error)) (*Set[T], error) {
	if m == nil {
		p, err := build(cfg)
		if err != nil {
			return nil, err
		}
		return &Set[T]{parts: []T{p}}, nil
	}
	parts := make([]T, 0, len(m.Shards))
	for _, sh := range m.Shards {
		p, err := build(forShard(sh))
		if err != nil {
			return nil, fmt.Errorf("shard %q: %w", sh.Name, err)
		}
		parts = append(parts, p)
	}
	return &Set[T]{m: m, parts: parts}, nil
}

// Len is the number of parts.
func (s *Set[T]) Len() int { return len(s.parts) }

// Part returns part i.
func (s *Set[T]) Part(i int) T { return s.parts[i] }

// Parts returns the parts in map order. The caller must not change the slice.
func (s *Set[T]) Parts() []T { return s.parts }

// Name is part i's shard name, "" for the part of one database.
func (s *Set[T]) Name(i int) string {
	if s.m == nil {
		return ""
	}
	return s.m.Shards[i].Name
}

// Names are the parts' shard names in map order (one "" for one database).
func (s *Set[T]) Names() []string {
	out := make([]string, len(s.parts))
	for i := range out {
		out[i] = s.Name(i)
	}
	return out
}

// Index returns the position of the tenant's part. Its error wraps
// shard.ErrRoute.
func (s *Set[T]) Index(tenant string) (int, error) {
	if s.m == nil {
		return 0, nil
	}
	return s.m.Index(tenant)
}

// Route returns the position of the part that tenant() names. With one part,
// tenant is not called: a front pays nothing for routing on one database.
func (s *Set[T]) Route(tenant func() (string, error)) (int, error) {
	if s.m == nil {
		return 0, nil
	}
	t, err := tenant()
	if err != nil {
		return -1, err
	}
	return s.m.Index(t)
}

// IndexOf returns the position of the part named name: the shard of that name,
// or, with one database, the one part for "". Another name is -1.
func (s *Set[T]) IndexOf(name string) int {
	for i := range s.parts {
		if s.Name(i) == name {
			return i
		}
	}
	return -1
}

// Named wraps err with part i's shard name; the part of one database adds
// nothing.
func (s *Set[T]) Named(i int, err error) error {
	if err == nil || s.m == nil {
		return err
	}
	return fmt.Errorf("shard %q: %w", s.m.Shards[i].Name, err)
}

// Each calls fn on every part in map order, one after another, and returns their
// errors joined, each named by its shard. A part that fails does not stop the
// others. With one database, fn's error is returned as it is.
func (s *Set[T]) Each(fn func(i int, p T) error) error {
	if s.m == nil {
		return fn(0, s.parts[0])
	}
	errs := make([]error, len(s.parts))
	for i, p := range s.parts {
		errs[i] = s.Named(i, fn(i, p))
	}
	return errors.Join(errs...)
}

// Parallel calls fn on every part at once and waits for them all; its errors are
// joined as Each joins them. With one database, fn runs on the caller's goroutine
// and its error is returned as it is.
func (s *Set[T]) Parallel(fn func(i int, p T) error) error {
	if s.m == nil {
		return fn(0, s.parts[0])
	}
	errs := make([]error, len(s.parts))
	var wg sync.WaitGroup
	for i, p := range s.parts {
		wg.Go(func() { errs[i] = s.Named(i, fn(i, p)) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// Collect calls fn on every part at once and returns each result and error in map
// order (errors not named: the caller decides how a shard's failure shows).
func Collect[T, R any](s *Set[T], fn func(i int, p T) (R, error)) ([]R, []error) {
	out := make([]R, len(s.parts))
	errs := make([]error, len(s.parts))
	if len(s.parts) == 1 {
		out[0], errs[0] = fn(0, s.parts[0])
		return out, errs
	}
	var wg sync.WaitGroup
	for i, p := range s.parts {
		wg.Go(func() { out[i], errs[i] = fn(i, p) })
	}
	wg.Wait()
	return out, errs
}

// Front returns the handler of a front over s: part(p) for every part p and, with
// one database, that part's handler itself, so the front adds nothing to a call
// (no route, no allocation). With a shard map it returns routed(hs), hs being the
// parts' handlers in map order, for routed to pick one a call.
func Front[T, H any](s *Set[T], part func(T) H, routed func(hs []H) H) H {
	hs := make([]H, len(s.parts))
	for i, p := range s.parts {
		hs[i] = part(p)
	}
	if s.m == nil {
		return hs[0]
	}
	return routed(hs)
}

// Label returns log and reg for a shard's part: log with the attribute
// shard=name, reg with the constant label shard=name on every series (nil for a
// nil reg).
func Label(sh shard.Shard, log *slog.Logger, reg prometheus.Registerer) (*slog.Logger, prometheus.Registerer) {
	return log.With("shard", sh.Name), promreg.Shard(reg, sh.Name)
}

// SchemaTargets are the databases a front checks at start (schemacheck.Start):
// every shard of m, named, or db and schema when m is nil.
func SchemaTargets(m *shard.Map, db schemacheck.Beginner, schema string) []schemacheck.Target {
	if m == nil {
		return []schemacheck.Target{{DB: db, Schema: schema}}
	}
	out := make([]schemacheck.Target, 0, len(m.Shards))
	for _, s := range m.Shards {
		out = append(out, schemacheck.Target{Shard: s.Name, DB: s.Pool, Schema: s.SchemaName()})
	}
	return out
}

// Schema is a config's Schema with its default: def for one database (m nil)
// when schema is unset; with a shard map, schema as given, since each shard
// names its own (and ValidateDB refuses a Schema beside Shards).
func Schema(m *shard.Map, schema, def string) string {
	if m == nil && schema == "" {
		return def
	}
	return schema
}

// ValidateDB checks the database a config hands over, the same way in every
// package: one database (pool and schema) or a shard map (m), not both. With m
// nil, pool is required (its zero value, a nil pointer or interface, is refused)
// and schema must be a valid name; with m set, a pool or schema too is refused
// (invalid_config) and m must be valid (see shard.Map.Validate).
func ValidateDB[P comparable](m *shard.Map, pool P, schema string) error {
	if m == nil {
		return pgschema.ValidateDB(pool, schema)
	}
	var none P
	if pool != none || schema != "" {
		return errcode.InvalidConfig("Pool and Schema name one database, Shards several: set one or the other (each shard has its own pool and schema)")
	}
	return m.Validate()
}
