package main

import (
	"context"
	"fmt"

	"github.com/spf13/pflag"

	"github.com/idemkit/idem/admin"
)

var findCmd = &command{
	name:    "find",
	args:    "--key K [--tenant T] [--kind K] [flags]",
	summary: "Look a key up everywhere: the inbox keys of every consumer and HTTP operation, and the effects of every kind",
	example: `idem find --key pay_789
idem find --key receipt:pay_789 --tenant acme --json

It probes the primary keys once per (consumer, tenant) and (tenant, kind) pair,
so it does not scan the tables; it shows at most 100 rows of each.`,
	setup: func(fs *pflag.FlagSet) runFunc {
		var key, kind string
		var tenant optString
		fs.StringVar(&key, "key", "", "the key: an idempotency key or an effect key (required)")
		fs.Var(&tenant, "tenant", "only this tenant ('' for the unscoped rows; default every tenant)")
		fs.StringVar(&kind, "kind", "", "only effects of this kind")
		return func(ctx context.Context, e *env, args []string) error {
			if err := noArgs(args); err != nil {
				return err
			}
			if key == "" {
				return usagef("--key is required")
			}
			a, err := e.admin(ctx)
			if err != nil {
				return err
			}
			found, err := a.Find(ctx, key, admin.FindFilter{Tenant: tenant.ptr(), Kind: kind})
			if err != nil {
				return usageIfBad(err)
			}
			if e.json {
				return e.writeJSON(found)
			}
			fmt.Fprintf(e.stdout, "Inbox keys %q: %d\n", printable(key), len(found.Inbox))
			if len(found.Inbox) > 0 {
				if err := e.inboxTable(found.Inbox); err != nil {
					return err
				}
			}
			fmt.Fprintf(e.stdout, "\nEffects with key %q: %d\n", printable(key), len(found.Effects))
			if len(found.Effects) > 0 {
				return e.effectsTable(found.Effects)
			}
			return nil
		}
	},
}
