package janitor

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/idemkit/idem/shard"
)

// shardSet is a Janitor's shard map: one single-database Janitor a shard, in map
// order, each with its own advisory lock on its own database, so one pass runs at
// a time per shard across all processes.
type shardSet struct {
	names []string
	each  []*Janitor
}

func newSharded(cfg Config) (*Janitor, error) {
	each, err := shard.Each(cfg.Shards, cfg.forShard, New)
	if err != nil {
		return nil, err
	}
	return &Janitor{cfg: cfg, shards: &shardSet{names: cfg.Shards.Names(), each: each}}, nil
}

// forShard returns c for sh's part of a sharded Janitor: sh's database, and c's
// logger and registerer labelled with sh's name.
func (c Config) forShard(sh shard.Shard) Config {
	c.Shards, c.Pool, c.Schema = nil, sh.Pool, sh.SchemaName()
	c.Logger, c.Registerer = sh.Label(c.Logger, c.Registerer)
	return c
}

// run runs every shard's Janitor until ctx ends.
func (s *shardSet) run(ctx context.Context) error {
	var wg sync.WaitGroup
	for _, j := range s.each {
		wg.Go(func() { _ = j.Run(ctx) })
	}
	wg.Wait()
	return nil
}

// runOnce runs one pass on every shard, one after another, and adds up what they
// deleted. A shard that fails, or whose lock another janitor holds (ErrBusy), does
// not stop the others; the error names each such shard.
func (s *shardSet) runOnce(ctx context.Context) (Stats, error) {
	var total Stats
	var errs []error
	start := time.Now()
	for i, j := range s.each {
		st, err := j.RunOnce(ctx)
		total.InboxDeleted += st.InboxDeleted
		total.EffectsDeleted += st.EffectsDeleted
		total.Batches += st.Batches
		if err != nil {
			errs = append(errs, fmt.Errorf("shard %q: %w", s.names[i], err))
		}
	}
	total.Elapsed = time.Since(start)
	return total, errors.Join(errs...)
}
