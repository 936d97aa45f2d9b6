package effects

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/shard"
)

// shardSet is a Dispatcher's shard map: one single-database Dispatcher a shard, in
// map order, each with its own claim loop, LISTEN connection (reconnected with
// backoff while its poll goes on) and lanes (Concurrency is per shard). They share
// the Senders and the Prometheus collectors; the pending gauge is the sum over the
// shards, counted by the sharded Dispatcher.
type shardSet struct {
	names []string
	each  []*Dispatcher
}

func newShardedDispatcher(cfg Config) (*Dispatcher, error) {
	each, err := shard.Each(cfg.Shards, func(sh shard.Shard) (*Dispatcher, error) {
		one := cfg
		one.Shards, one.Pool, one.Schema = nil, sh.Pool, sh.SchemaName()
		one.Logger = cfg.Logger.With("shard", sh.Name)
		d, err := NewDispatcher(one)
		if err == nil {
			d.noPending = true // the sharded Dispatcher counts the sum
		}
		return d, err
	})
	if err != nil {
		return nil, err
	}
	s := &shardSet{names: cfg.Shards.Names(), each: each}
	return &Dispatcher{cfg: cfg, log: cfg.Logger, m: s.each[0].m, shards: s}, nil
}

// run runs every shard's Dispatcher until ctx ends. A shard that is down does not
// stop the others: its claim loop retries with backoff, and its LISTEN connection
// reconnects, until the shard is back.
func (s *shardSet) run(ctx context.Context, d *Dispatcher) error {
	errs := make([]error, len(s.each))
	var wg sync.WaitGroup
	for i, one := range s.each {
		wg.Go(func() {
			if err := one.Run(ctx); err != nil {
				errs[i] = fmt.Errorf("shard %q: %w", s.names[i], err)
			}
		})
	}
	if d.cfg.Registerer != nil {
		wg.Go(func() { s.refreshPendingLoop(ctx, d) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// refreshPendingLoop sets idem_effects_pending to the sum over the shards.
func (s *shardSet) refreshPendingLoop(ctx context.Context, d *Dispatcher) {
	t := time.NewTicker(d.cfg.PendingRefresh)
	defer t.Stop()
	seen := map[string]bool{}
	for kind := range d.cfg.Senders {
		seen[kind] = true
	}
	for {
		counts := map[string]float64{}
		ok := true
		for _, one := range s.each {
			if err := one.countPending(ctx, counts); err != nil {
				ok = false // a shard down: keep the last sums rather than undercount
				break
			}
		}
		if ok {
			for k := range counts {
				seen[k] = true
			}
			for k := range seen {
				d.m.pending.WithLabelValues(k).Set(counts[k])
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// countPending adds this Dispatcher's schema's pending effects, by kind, to counts.
func (d *Dispatcher) countPending(ctx context.Context, counts map[string]float64) error {
	rows, err := d.pool.Query(ctx, d.q.pending)
	if err != nil {
		return err
	}
	var kind string
	var n int64
	_, err = pgx.ForEachRow(rows, []any{&kind, &n}, func() error { counts[kind] += float64(n); return nil })
	return err
}
