package main

import (
	"context"
	"fmt"
	"strings"

	"github.com/spf13/pflag"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/internal/effectsdb"
)

var effectsRequeueCmd = &command{
	name:    "effects requeue",
	args:    "--kind K (--key K | --all-dead) [--tenant T] [flags]",
	summary: "Bring dead effects back to pending, due now, with their attempts reset",
	example: `idem effects requeue --kind email --key receipt:pay_789
idem effects requeue --kind email --tenant acme --key receipt:pay_789
idem effects requeue --kind email --all-dead --json

Without --tenant, --key takes that key's dead effect in every tenant (two
tenants' receipt:pay_789 are two effects); --tenant '' is the unscoped one alone.`,
	setup: func(fs *pflag.FlagSet) runFunc {
		var o requeueOptions
		fs.StringVar(&o.kind, "kind", "", "effect kind (required)")
		fs.StringVar(&o.key, "key", "", "one effect key")
		fs.BoolVar(&o.all, "all-dead", false, "every dead effect of the kind")
		fs.Var(&o.tenant, "tenant", "only this tenant ('' for the unscoped effects; default every tenant)")
		return runWith(&o, runEffectsRequeue)
	},
}

type requeueOptions struct {
	kind, key string
	all       bool
	tenant    optString
}

func runEffectsRequeue(ctx context.Context, e *env, args []string, o requeueOptions) error {
	if err := noArgs(args); err != nil {
		return err
	}
	if o.kind == "" {
		return usagef("--kind is required")
	}
	if (o.key == "") == !o.all {
		return usagef("give exactly one of --key K or --all-dead")
	}
	if err := effectsdb.ValidateEffect(effectsdb.Effect{Kind: o.kind, Key: "x"}); err != nil {
		return usagef("%v", err)
	}
	a, err := e.admin(ctx)
	if err != nil {
		return err
	}
	n, err := a.RequeueDead(ctx, effectsdb.RequeueFilter{Kind: o.kind, Key: o.key, All: o.all,
		Tenant: o.tenant.v, TenantExact: o.tenant.set})
	if err != nil {
		return err
	}
	if n == 0 && o.key != "" {
		return whyNotRequeued(ctx, e, a, o)
	}
	if e.json {
		out := map[string]any{"schema": e.schema, "kind": o.kind, "key": o.key, "requeued": n}
		if o.tenant.set {
			out["tenant"] = o.tenant.v
		}
		return e.writeJSON(out)
	}
	if n == 0 {
		fmt.Fprintf(e.stdout, "no dead %s effects: nothing to requeue\n", o.kind)
		return nil
	}
	fmt.Fprintf(e.stdout, "requeued %d dead %s effect(s); dispatchers were notified and will send them now\n", n, o.kind)
	return nil
}

// whyNotRequeued says why --key requeued nothing: a typo and a live effect need
// different answers.
func whyNotRequeued(ctx context.Context, e *env, a *admin.Admin, o requeueOptions) error {
	found, err := a.Find(ctx, o.key, admin.FindFilter{Tenant: o.tenant.ptr(), Kind: o.kind})
	if err != nil {
		return err
	}
	if len(found.Effects) == 0 {
		in := ""
		if o.tenant.set {
			in = fmt.Sprintf(" in tenant %q", o.tenant.v)
		}
		return codedf(admin.ErrNotFound, "no effect of kind %q with key %q%s (check both; 'idem effects list --kind %s' shows the dead ones)",
			o.kind, o.key, in, shellQuote(o.kind))
	}
	var states []string
	for _, x := range found.Effects {
		states = append(states, fmt.Sprintf("effect %s is %s", printable(x.ID().String()), x.State))
	}
	return codedf(admin.ErrNotDead, "%s, not dead: nothing to requeue", strings.Join(states, "; "))
}
