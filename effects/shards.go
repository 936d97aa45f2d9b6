package effects

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/idemkit/idem/internal/schemacheck"
	"github.com/idemkit/idem/shard"
)

// shardSet is a Dispatcher's shard map: one single-database Dispatcher a shard, in
// map order, each with its own claim loop, LISTEN connection (reconnected with
// backoff while its poll goes on) and lanes (Concurrency is per shard). They share
// the Senders; each has its own Prometheus series, labelled with its shard's name
// (its pending gauge counts its shard's effects).
type shardSet struct {
	names []string
	each  []*Dispatcher
}

func newShardedDispatcher(cfg Config) (*Dispatcher, error) {
	each, err := shard.Each(cfg.Shards, cfg.forShard, NewDispatcher)
	if err != nil {
		return nil, err
	}
	return &Dispatcher{cfg: cfg, log: cfg.Logger, shards: &shardSet{names: cfg.Shards.Names(), each: each}}, nil
}

// schemaTargets are the databases New checks at start: every shard, or Pool and
// Schema.
func (c Config) schemaTargets() []schemacheck.Target {
	if c.Shards == nil {
		return []schemacheck.Target{{DB: c.Pool, Schema: c.Schema}}
	}
	out := make([]schemacheck.Target, 0, len(c.Shards.Shards))
	for _, s := range c.Shards.Shards {
		out = append(out, schemacheck.Target{Shard: s.Name, DB: s.Pool, Schema: s.SchemaName()})
	}
	return out
}

// forShard returns c for sh's part of a sharded Dispatcher: sh's database, and c's
// logger and registerer labelled with sh's name.
func (c Config) forShard(sh shard.Shard) Config {
	c.Shards, c.Pool, c.Schema = nil, sh.Pool, sh.SchemaName()
	c.SkipSchemaCheck = true // New checked every shard
	c.Logger, c.Registerer = sh.Label(c.Logger, c.Registerer)
	return c
}

// run runs every shard's Dispatcher until ctx ends. A shard that is down does not
// stop the others: its claim loop retries with backoff, and its LISTEN connection
// reconnects, until the shard is back.
func (s *shardSet) run(ctx context.Context) error {
	errs := make([]error, len(s.each))
	var wg sync.WaitGroup
	for i, one := range s.each {
		wg.Go(func() {
			if err := one.Run(ctx); err != nil {
				errs[i] = fmt.Errorf("shard %q: %w", s.names[i], err)
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}
