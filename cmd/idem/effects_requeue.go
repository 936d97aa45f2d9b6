package main

import (
	"context"
	"errors"
	"flag"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/effects"
)

var effectsRequeueCmd = &command{
	name:    "effects requeue",
	args:    "--kind K (--key K | --all-dead) [flags]",
	summary: "Bring dead effects back to pending, due now, with their attempts reset",
	example: `idem effects requeue --kind email --key receipt:pay_789
idem effects requeue --kind email --all-dead --json`,
	setup: func(fs *flag.FlagSet) runFunc {
		var kind, key string
		var all bool
		fs.StringVar(&kind, "kind", "", "effect kind (required)")
		fs.StringVar(&key, "key", "", "one effect key")
		fs.BoolVar(&all, "all-dead", false, "every dead effect of the kind")
		return func(ctx context.Context, e *env, args []string) error {
			return runEffectsRequeue(ctx, e, args, kind, key, all)
		}
	},
}

func runEffectsRequeue(ctx context.Context, e *env, args []string, kind, key string, all bool) error {
	if len(args) > 0 {
		return usagef("takes no arguments, got %q", args)
	}
	if kind == "" {
		return usagef("--kind is required")
	}
	if (key == "") == !all {
		return usagef("give exactly one of --key K or --all-dead")
	}
	if err := effects.ValidateEffect(effects.Effect{Kind: kind, Key: "x"}); err != nil {
		return usagef("%v", err)
	}
	pool, err := e.connect(ctx)
	if err != nil {
		return err
	}
	n, err := effects.RequeueDead(ctx, pool, e.schema, effects.RequeueFilter{Kind: kind, Key: key, All: all})
	if err != nil {
		return err
	}
	if n == 0 && key != "" {
		// Say why nothing happened: a typo and a live effect need different answers.
		var state string
		err := pool.QueryRow(ctx, newQueries(e.schema).effectState, kind, key).Scan(&state)
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("no effect of kind %q with key %q (check both; 'idem effects list --kind %s' shows the dead ones)", kind, key, kind)
		}
		if err != nil {
			return err
		}
		return fmt.Errorf("effect %s/%s is %s, not dead: nothing to requeue", kind, key, state)
	}
	if e.json {
		return e.writeJSON(map[string]any{"schema": e.schema, "kind": kind, "key": key, "requeued": n})
	}
	if n == 0 {
		fmt.Fprintf(e.stdout, "no dead %s effects: nothing to requeue\n", kind)
		return nil
	}
	fmt.Fprintf(e.stdout, "requeued %d dead %s effect(s); dispatchers were notified and will send them now\n", n, kind)
	return nil
}
