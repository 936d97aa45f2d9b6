package main

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/spf13/pflag"

	"github.com/idemkit/idem/admin"
)

var shardMoveCmd = &command{
	name:    "shard move-tenant",
	args:    "--tenant T --to SHARD [--from SHARD] [--effects-retention D] [--dry-run] [flags]",
	summary: "Move a drained tenant's inbox keys and effects from its old shard to its new one (before its route is switched)",
	example: `idem shard move-tenant --shards shards.json --tenant acme --to s3 --dry-run
idem shard move-tenant --shards shards.json --tenant acme --to s3

The procedure (docs/sharding.md): drain the tenant (stop what handles its
messages and requests), run this, switch its route (a "table" entry naming the
new shard, in every process), resume. It copies the inbox keys that have not
expired and the pending, dead, discarded and recently done effects, and deletes
every row of the tenant from the old shard: pending effects are sent, and dead
effects and failed keys repaired, from the new shard alone. A move that failed
half-way is finished by running it again.
Without it, a redelivery of a message the old shard recorded runs its handler
again on the new shard, and the old shard's pending effects are sent from there.
--from defaults to the shard the map's route gives the tenant now.`,
	setup: func(fs *pflag.FlagSet) runFunc {
		var mv admin.MoveTenant
		fs.StringVar(&mv.Tenant, "tenant", "", "the tenant to move (required)")
		fs.StringVar(&mv.To, "to", "", "its new shard (required)")
		fs.StringVar(&mv.From, "from", "", "its old shard (default: the one its route gives now)")
		durationVar(fs, &mv.EffectsRetention, "effects-retention", admin.DefaultMoveRetention, "copy the effects done within this long (older ones are deleted, not copied)")
		fs.BoolVar(&mv.DryRun, "dry-run", false, "show the plan, change nothing")
		return func(ctx context.Context, e *env, args []string) error {
			if err := noArgs(args); err != nil {
				return err
			}
			return runShardMove(ctx, e, mv)
		}
	},
}

func runShardMove(ctx context.Context, e *env, mv admin.MoveTenant) error {
	if !e.shardsGiven() {
		return usagef("moving a tenant needs the shard map: --shards FILE or --shard NAME=URL for each shard")
	}
	if mv.Tenant == "" || mv.To == "" {
		return usagef("--tenant and --to are required")
	}
	if mv.EffectsRetention <= 0 {
		return usagef("--effects-retention must be above 0")
	}
	a, err := e.admin(ctx)
	if err != nil {
		return err
	}
	start := time.Now()
	res, err := a.MoveTenant(ctx, mv)
	if res != nil && e.json {
		if werr := e.writeJSON(res); werr != nil {
			return werr
		}
	} else if res != nil {
		counts := func(m map[string]int64) string {
			if len(m) == 0 {
				return "none"
			}
			var parts []string
			for _, k := range slices.Sorted(maps.Keys(m)) {
				parts = append(parts, fmt.Sprintf("%d %s", m[k], k))
			}
			return strings.Join(parts, ", ")
		}
		fmt.Fprintf(e.stdout, "tenant %q: shard %s -> %s\n", printable(res.Tenant), res.From, res.To)
		fmt.Fprintf(e.stdout, "  inbox keys to copy: %s\n  effects to copy: %s\n  busy (processing under a lease, being sent): %d\n",
			counts(res.InboxKeys), counts(res.Effects), res.Busy)
		if res.DryRun {
			fmt.Fprintln(e.stdout, "dry run: nothing was changed")
		} else if err == nil {
			fmt.Fprintf(e.stdout, "copied %d inbox keys and %d effects (rows already there kept), handed over %d pending effects, deleted %d inbox keys and %d effects from %s, in %s\n",
				res.InboxCopied, res.EffectsCopied, res.HandedOver, res.InboxDeleted, res.EffectsDeleted, res.From, time.Since(start).Round(time.Millisecond))
			fmt.Fprintf(e.stdout, "now route tenant %q to %s (a \"table\" entry) in every process, then resume it\n", printable(res.Tenant), res.To)
		}
	}
	return err
}
