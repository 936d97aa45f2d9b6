package effects

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/idemkit/idem/internal/promreg"
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
	each, err := shard.Each(cfg.Shards, func(sh shard.Shard) (*Dispatcher, error) {
		one := cfg
		one.Shards, one.Pool, one.Schema = nil, sh.Pool, sh.SchemaName()
		one.Logger = cfg.Logger.With("shard", sh.Name)
		one.Registerer = promreg.Shard(cfg.Registerer, sh.Name)
		return NewDispatcher(one)
	})
	if err != nil {
		return nil, err
	}
	s := &shardSet{names: cfg.Shards.Names(), each: each}
	return &Dispatcher{cfg: cfg, log: cfg.Logger, shards: s}, nil
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
