package main

import (
	"context"
	"flag"
	"fmt"
	"slices"
)

var effectsListCmd = &command{
	name:    "effects list",
	args:    "[--state dead|pending|done] [--kind K] [--limit N] [flags]",
	summary: "List effects in one state (dead by default), oldest first, with their last error",
	example: `idem effects list --state dead --kind email
idem effects list --state pending --limit 20 --json`,
	setup: func(fs *flag.FlagSet) runFunc {
		var state, kind string
		var limit int
		fs.StringVar(&state, "state", "dead", "dead, pending or done")
		fs.StringVar(&kind, "kind", "", "only this kind")
		fs.IntVar(&limit, "limit", 100, "at most this many rows")
		return func(ctx context.Context, e *env, args []string) error {
			return runEffectsList(ctx, e, args, state, kind, limit)
		}
	},
}

func runEffectsList(ctx context.Context, e *env, args []string, state, kind string, limit int) error {
	if len(args) > 0 {
		return usagef("takes no arguments, got %q", args)
	}
	if !slices.Contains([]string{"dead", "pending", "done"}, state) {
		return usagef("--state %q: use dead, pending or done", state)
	}
	if limit < 1 {
		return usagef("--limit must be at least 1")
	}
	pool, err := e.connect(ctx)
	if err != nil {
		return err
	}
	rows, err := pool.Query(ctx, newQueries(e.schema).effectsList, state, kind, limit)
	if err != nil {
		return err
	}
	effs, err := scanEffects(rows)
	if err != nil {
		return err
	}
	if e.json {
		return e.writeJSON(nonNil(effs))
	}
	if len(effs) == 0 {
		what := state
		if kind != "" {
			what += " " + kind
		}
		fmt.Fprintf(e.stdout, "no %s effects\n", what)
		return nil
	}
	if err := e.effectsTable(effs); err != nil {
		return err
	}
	if len(effs) == limit {
		fmt.Fprintf(e.stdout, "(first %d shown; raise --limit for more)\n", limit)
	}
	return nil
}
