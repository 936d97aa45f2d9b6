package httpidem

import (
	"fmt"
	"net/http"

	"github.com/idemkit/idem/inbox"
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
	s := &shardSet{m: cfg.Shards}
	for _, sh := range cfg.Shards.Shards {
		one := cfg
		one.Shards = nil
		one.Pool = sh.Pool
		one.Schema = sh.SchemaName()
		one.Logger = cfg.Logger.With("shard", sh.Name)
		mw, err := New(one)
		if err != nil {
			return nil, fmt.Errorf("shard %q: %w", sh.Name, err)
		}
		s.each = append(s.each, mw)
	}
	return &Middleware{cfg: cfg, metrics: s.each[0].metrics, log: cfg.Logger, shards: s}, nil
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
		if t, err := tenant(r); err == nil && t != "" && inbox.ValidateTenant(t) == nil {
			if i, err = s.m.Index(t); err != nil {
				log.Error("idem: no shard for the request's tenant", "tenant", t, "err", err)
				writeProblem(w, CodeShardRoute, "the server has no shard for this tenant; nothing was run", 0)
				return
			}
		}
		hs[i].ServeHTTP(w, r)
	})
}
