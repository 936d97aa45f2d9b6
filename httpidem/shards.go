package httpidem

import (
	"net/http"

	"github.com/idemkit/idem/internal/fanout"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/schemacheck"
	"github.com/idemkit/idem/shard"
)

// shardSet is a Middleware's shard map: one single-database Middleware a shard, in
// map order. The request's tenant picks its shard's Middleware, which claims, runs
// and commits the request on that shard as it would alone.
type shardSet struct {
	m    *shard.Map
	each []*Middleware
}

func newSharded(cfg Config) (*Middleware, error) {
	each, err := shard.Each(cfg.Shards, cfg.forShard, New)
	if err != nil {
		return nil, err
	}
	return &Middleware{cfg: cfg, log: cfg.Logger, shards: &shardSet{m: cfg.Shards, each: each}}, nil
}

// schemaTargets are the databases New checks at start: every shard, or Pool and
// Schema.
func (c Config) schemaTargets() []schemacheck.Target {
	return fanout.SchemaTargets(c.Shards, c.Pool, c.Schema)
}

// forShard returns c for sh's part of a sharded Middleware: sh's database, and c's
// logger and registerer labelled with sh's name.
func (c Config) forShard(sh shard.Shard) Config {
	c.Shards, c.Pool, c.Schema = nil, sh.Pool, sh.SchemaName()
	c.SkipSchemaCheck = true // New checked every shard
	c.Logger, c.Registerer = sh.Label(c.Logger, c.Registerer)
	return c
}

// parts are the Middlewares that do the work: one a shard, or m itself.
func (m *Middleware) parts() []*Middleware {
	if m.shards != nil {
		return m.shards.each
	}
	return []*Middleware{m}
}

// route returns a handler that sends each request to its tenant's shard. A request
// whose tenant cannot be read goes to the first shard, whose Middleware refuses it
// (tenant_invalid) without touching the database, as it would without shards; a
// route that fails is answered with shard_route.
func (s *shardSet) route(rt Route, next http.Handler) http.Handler {
	hs := make([]http.Handler, len(s.each))
	for i, mw := range s.each {
		hs[i] = mw.Route(rt)(next)
	}
	tenant := s.each[0].cfg.Tenant
	log := s.each[0].log
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		i := 0
		if t, err := tenant(r); err == nil && t != "" && inboxdb.ValidateTenant(t) == nil {
			if i, err = s.m.Index(t); err != nil {
				log.Error("idem: no shard for the request's tenant", "tenant", t, "err", err)
				writeProblem(w, CodeShardRoute, "the server has no shard for this tenant; nothing was run", 0)
				return
			}
		}
		hs[i].ServeHTTP(w, r)
	})
}
