// Package shard is idem's shard map: several independent Postgres databases, each a
// shard with a name, a pool and a schema, and a route from tenant to shard. A
// tenant's inbox rows, effects and business rows live on one shard, so every
// statement idem issues is a single-database statement and every guarantee holds
// per shard.
//
// The consumer, effects (Dispatcher and Enqueue), httpidem, janitor and migrate
// configs each take a *Map in their Shards field in place of Pool and Schema. A
// config with Pool and Schema (and no Shards) is one database, as before, at no
// extra cost.
//
// The route: Table, if it names the tenant, wins; else Route, if set; else a
// rendezvous (highest random weight) hash of the tenant over the shard names. The
// hash depends only on the names, so it is the same in every process and stable
// under reordering the shards; adding a shard moves to it only the tenants it now
// wins (about 1/n of them), and removing one moves only its own tenants.
//
// Moving a tenant between shards (a Table entry, a new shard) moves where its new
// rows go, not the rows it has: until they are copied, a redelivery of a message
// the old shard recorded is not recognised as a duplicate on the new one. See
// docs/sharding.md.
//
// It imports nothing public of idem, so every package can use it.
package shard

import (
	"fmt"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/pgschema"
)

// ErrRoute is returned when the route gives no shard for a tenant: the Route
// function failed or named a shard the map does not have. It is permanent (the
// message is not placed anywhere, so nothing can be recorded for it) and, as an
// error from a key function, it is returned to the broker: put a PoisonQueue
// outside idem.
var ErrRoute = errcode.Permanent("shard_route", "the shard route gave no shard of the map for the tenant")

// MaxNameLen bounds a shard's name.
const MaxNameLen = 63

// Shard is one database of a Map.
type Shard struct {
	// Name identifies the shard in routes, logs, metrics and the admin API. The
	// hash route depends on it: renaming a shard moves tenants.
	Name string
	// Pool is the shard's database.
	Pool *pgxpool.Pool
	// Schema holds the idem tables on the shard (default "idem").
	Schema string
}

// SchemaName is s.Schema, or the default "idem".
func (s Shard) SchemaName() string {
	if s.Schema == "" {
		return pgschema.Default
	}
	return s.Schema
}

// Map is a set of shards and the route from tenant to shard. Do not change a Map
// after giving it to idem.
type Map struct {
	// Shards are the databases, at least one. Names are unique, and no two shards
	// share a pool and schema.
	Shards []Shard
	// Table, if set, routes the tenants it names to the shard it names, over Route
	// and the hash.
	Table map[string]string
	// Route, if set, routes the tenants Table does not name, in place of the hash.
	// It must return a shard's Name, the same for a tenant in every process.
	Route func(tenant string) (string, error)
}

// Validate reports a map idem would refuse: no shards, an empty, too long, invalid
// or repeated name, a shard without a Pool, an invalid schema, two shards on the
// same pool and schema, or a Table entry naming no shard. Errors are coded
// invalid_config (errors.Is ErrInvalidConfig), or invalid_schema.
func (m *Map) Validate() error {
	if m == nil || len(m.Shards) == 0 {
		return errcode.InvalidConfig("shard map has no shards")
	}
	type place struct {
		pool   *pgxpool.Pool
		schema string
	}
	names := make(map[string]bool, len(m.Shards))
	places := make(map[place]string, len(m.Shards))
	for i, s := range m.Shards {
		switch {
		case s.Name == "":
			return errcode.InvalidConfig("shard %d has no Name", i)
		case len(s.Name) > MaxNameLen || !utf8.ValidString(s.Name) || !printable(s.Name):
			return errcode.InvalidConfig("shard %d: Name %q must be printable UTF-8 of at most %d bytes", i, s.Name, MaxNameLen)
		case names[s.Name]:
			return errcode.InvalidConfig("shard name %q appears twice", s.Name)
		case s.Pool == nil:
			return errcode.InvalidConfig("shard %q has no Pool", s.Name)
		}
		if err := pgschema.Validate(s.SchemaName()); err != nil {
			return fmt.Errorf("shard %q: %w", s.Name, err)
		}
		p := place{s.Pool, s.SchemaName()}
		if other, ok := places[p]; ok {
			return errcode.InvalidConfig("shards %q and %q share a pool and schema", other, s.Name)
		}
		names[s.Name] = true
		places[p] = s.Name
	}
	for tenant, name := range m.Table {
		if !names[name] {
			return errcode.InvalidConfig("Table routes tenant %q to %q, which is not a shard of the map", tenant, name)
		}
	}
	return nil
}

func printable(s string) bool {
	for _, r := range s {
		if r < 0x20 || r == 0x7f {
			return false
		}
	}
	return true
}

// Index returns the position in m.Shards of the tenant's shard. Its error wraps
// ErrRoute. m must be valid.
func (m *Map) Index(tenant string) (int, error) {
	if name, ok := m.Table[tenant]; ok {
		return m.index(tenant, name)
	}
	if m.Route != nil {
		name, err := m.Route(tenant)
		if err != nil {
			return -1, fmt.Errorf("%w: tenant %q: %w", ErrRoute, tenant, err)
		}
		return m.index(tenant, name)
	}
	return rendezvous(tenant, m.Shards), nil
}

// Pick returns the tenant's shard (see Index).
func (m *Map) Pick(tenant string) (Shard, error) {
	i, err := m.Index(tenant)
	if err != nil {
		return Shard{}, err
	}
	return m.Shards[i], nil
}

func (m *Map) index(tenant, name string) (int, error) {
	for i := range m.Shards {
		if m.Shards[i].Name == name {
			return i, nil
		}
	}
	return -1, fmt.Errorf("%w: tenant %q routed to %q, which is not a shard of the map", ErrRoute, tenant, name)
}

// Names returns the shards' names in map order.
func (m *Map) Names() []string {
	out := make([]string, len(m.Shards))
	for i, s := range m.Shards {
		out[i] = s.Name
	}
	return out
}

// rendezvous returns the index of the shard whose name scores highest for the
// tenant (rendezvous, or highest-random-weight, hashing). Ties, which need a 64-bit
// collision, go to the smaller name, so the order of shards never matters.
func rendezvous(tenant string, shards []Shard) int {
	best, bestScore := -1, uint64(0)
	for i := range shards {
		sc := score(shards[i].Name, tenant)
		if best < 0 || sc > bestScore || (sc == bestScore && shards[i].Name < shards[best].Name) {
			best, bestScore = i, sc
		}
	}
	return best
}

// score is the rendezvous weight of the shard name for the tenant: FNV-1a (64-bit)
// over the name, a zero byte and the tenant, then the splitmix64 finaliser so that
// near names spread well. It is part of the on-disk contract (it decides where a
// tenant's rows live) and never changes.
func score(name, tenant string) uint64 {
	const (
		offset = 14695981039346656037
		prime  = 1099511628211
	)
	h := uint64(offset)
	for i := range len(name) {
		h ^= uint64(name[i])
		h *= prime
	}
	h *= prime // the zero byte between name and tenant
	for i := range len(tenant) {
		h ^= uint64(tenant[i])
		h *= prime
	}
	h ^= h >> 30
	h *= 0xbf58476d1ce4e5b9
	h ^= h >> 27
	h *= 0x94d049bb133111eb
	h ^= h >> 31
	return h
}
