package main

import (
	"context"
	"fmt"
	"time"

	"github.com/spf13/pflag"

	"github.com/idemkit/idem/janitor"
)

var gcCmd = &command{
	name: "gc",
	args: "[flags]",
	summary: "Run the janitor once, to completion: delete expired inbox rows and done effects " +
		"past their retention",
	example: `idem gc
idem gc --batch-size 5000 --pause 0s --effects-retention 3d --json`,
	setup: func(fs *pflag.FlagSet) runFunc {
		var cfg janitor.Config
		fs.IntVar(&cfg.BatchSize, "batch-size", janitor.DefaultBatchSize, "rows per DELETE")
		durationVar(fs, &cfg.Pause, "pause", janitor.DefaultPause, "pause between batches (0s for none)")
		durationVar(fs, &cfg.EffectsRetention, "effects-retention", janitor.DefaultEffectsRetention, "how long done effects are kept after done_at")
		return func(ctx context.Context, e *env, args []string) error {
			if err := noArgs(args); err != nil {
				return err
			}
			return runGC(ctx, e, cfg)
		}
	},
}

type gcJSON struct {
	Schema         string   `json:"schema,omitempty"`
	Shards         []string `json:"shards,omitempty"`
	InboxDeleted   int64    `json:"inbox_deleted"`
	EffectsDeleted int64    `json:"effects_deleted"`
	Batches        int      `json:"batches"`
	ElapsedSeconds float64  `json:"elapsed_seconds"`
}

func runGC(ctx context.Context, e *env, cfg janitor.Config) error {
	if cfg.BatchSize < 1 {
		return usagef("--batch-size must be at least 1")
	}
	if cfg.Pause == 0 {
		cfg.Pause = -1 // the janitor reads 0 as "default"
	}
	if e.shardsGiven() {
		m, err := e.shardMap(ctx)
		if err != nil {
			return err
		}
		cfg.Shards = m
	} else {
		pool, err := e.connect(ctx)
		if err != nil {
			return err
		}
		cfg.Pool, cfg.Schema = pool, e.schema
	}
	// Progress goes to stderr, at most once a second, so that stdout holds only
	// the result; with --json, nowhere (stderr holds JSON only).
	var last time.Time
	cfg.OnBatch = func(s janitor.Stats) {
		if time.Since(last) < time.Second {
			return
		}
		last = time.Now()
		fmt.Fprintf(e.notes(), "  deleted %d inbox rows, %d effects so far (%.0f rows/s)\n",
			s.InboxDeleted, s.EffectsDeleted, float64(s.Deleted())/s.Elapsed.Seconds())
	}
	j, err := janitor.New(cfg)
	if err != nil {
		return usagef("%v", err)
	}
	st, err := j.RunOnce(ctx)
	if err != nil {
		return err
	}
	if e.json {
		out := gcJSON{Schema: e.schema, InboxDeleted: st.InboxDeleted, EffectsDeleted: st.EffectsDeleted,
			Batches: st.Batches, ElapsedSeconds: st.Elapsed.Seconds()}
		if cfg.Shards != nil {
			out.Schema, out.Shards = "", cfg.Shards.Names()
		}
		return e.writeJSON(out)
	}
	fmt.Fprintf(e.stdout, "deleted %d expired inbox rows and %d done effects from %s in %s\n",
		st.InboxDeleted, st.EffectsDeleted, e.where(), st.Elapsed.Round(time.Millisecond))
	return nil
}
