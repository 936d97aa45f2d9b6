package main

import (
	"context"
	"fmt"
	"slices"

	"github.com/spf13/pflag"

	"github.com/idemkit/idem/admin"
)

var effectsListCmd = &command{
	name:    "effects list",
	args:    "[--state dead|pending|done|all] [--stuck] [--kind K] [--tenant T] [--key-prefix P] [--consumer C] [--since T] [--until T] [--limit N] [--after CURSOR] [flags]",
	summary: "List effects in one state (dead by default) with their last error, in key order, a page at a time",
	example: `idem effects list --state dead --kind email
idem effects list --stuck                       # pending ones in flight, overdue, or failing again and again
idem effects list --state all --tenant acme --key-prefix receipt: --since 7d
idem effects list --state pending --limit 20 --json

Effects come in primary key order (tenant, kind, key). When more follow, the
last line gives the flags to add to the command for the next page: --after
CURSOR, and a --since or --until given as an age (7d) as the time it was read
as, so that the next page reads the same window (with --json, on stderr, as
{"next_after": CURSOR, "next_args": [...], ...}).
--since and --until take a time (2026-11-21T23:02:11Z), a date (2026-11-21) or
an age (90m, 7d: that long ago), and filter on when the effect was created.`,
	setup: func(fs *pflag.FlagSet) runFunc {
		var o effectsListOptions
		fs.StringVar(&o.state, "state", "dead", "dead, pending, done or all")
		fs.BoolVar(&o.f.Stuck, "stuck", false, "only pending effects that look stuck: in flight, due for a minute without a claim, or 3+ attempts")
		fs.StringVar(&o.f.Kind, "kind", "", "only this kind")
		fs.Var(&o.tenant, "tenant", "only this tenant ('' for the unscoped effects; default every tenant)")
		fs.StringVar(&o.f.KeyPrefix, "key-prefix", "", "only keys that start with this")
		fs.StringVar(&o.f.Consumer, "consumer", "", "only effects made by this consumer's messages (or this HTTP operation's requests)")
		timeVar(fs, &o.f.Created.Since, "since", "only effects created at or after this time")
		timeVar(fs, &o.f.Created.Until, "until", "only effects created before this time")
		pageFlags(fs, &o.p, 100, "rows")
		return func(ctx context.Context, e *env, args []string) error {
			o.stateGiven = flagGiven(fs, "state")
			return runEffectsList(ctx, e, args, o)
		}
	},
}

type effectsListOptions struct {
	f          admin.EffectFilter
	p          admin.Page
	state      string
	stateGiven bool
	tenant     optString
}

func runEffectsList(ctx context.Context, e *env, args []string, o effectsListOptions) error {
	if err := noArgs(args); err != nil {
		return err
	}
	if !slices.Contains([]string{"dead", "pending", "done", "all"}, o.state) {
		return usagef("--state %q: use dead, pending, done or all", o.state)
	}
	if err := checkLimit(o.p.Limit); err != nil {
		return err
	}
	o.f.State = o.state
	switch {
	case o.f.Stuck && !o.stateGiven:
		o.f.State = "pending"
	case o.f.Stuck && o.state != "pending":
		return usagef("--stuck lists pending effects: leave --state out")
	case o.state == "all":
		o.f.State = ""
	}
	o.f.Tenant = o.tenant.ptr()
	a, err := e.admin(ctx)
	if err != nil {
		return err
	}
	page, err := a.ListEffects(ctx, o.f, o.p)
	if err != nil {
		return usageIfBad(err)
	}
	none := o.state
	if o.f.Stuck {
		none = "stuck"
	}
	if o.f.Kind != "" {
		none += " " + o.f.Kind
	}
	return writePage(e, listPage[admin.Effect]{command: "effects list", what: "effects", items: page.Rows, next: page.Next},
		"no "+none+" effects", func() error {
			if err := e.effectsTable(page.Rows); err != nil {
				return err
			}
			if o.f.Stuck {
				fmt.Fprintln(e.stdout, "\nWhy each looks stuck:")
				for _, x := range page.Rows {
					fmt.Fprintf(e.stdout, "  %s: %s\n", printable(x.ID().String()), x.Stuck)
				}
			}
			return nil
		})
}
