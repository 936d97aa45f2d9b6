package main

import (
	"context"

	"github.com/spf13/pflag"

	"github.com/idemkit/idem/admin"
)

var inboxListCmd = &command{
	name:    "inbox list",
	args:    "[--consumer C] [--tenant T] [--state completed|failed|processing] [--key-prefix P] [--since T] [--until T] [--limit N] [--after CURSOR] [flags]",
	summary: "List inbox keys (messages' and HTTP requests') in key order, a page at a time",
	example: `idem inbox list --consumer payments --state failed
idem inbox list --consumer 'POST /payments' --tenant acct_42 --since 1d --json
idem inbox list --consumer payments --key-prefix pay_ --limit 50 --after eyJpbmJveCIsIC4uLl0

Keys come in primary key order (consumer, tenant, key). When more follow, the
last line gives the flags to add to the command for the next page: --after
CURSOR, and a --since or --until given as an age (1d) as the time it was read
as, so that the next page reads the same window (with --json, on stderr, as
{"next_after": CURSOR, "next_args": [...], ...}).
--since and --until filter on when the key was received.`,
	setup: func(fs *pflag.FlagSet) runFunc {
		var f admin.InboxFilter
		var p admin.Page
		var tenant optString
		fs.StringVar(&f.Consumer, "consumer", "", "only this consumer (or HTTP operation)")
		fs.Var(&tenant, "tenant", "only this tenant ('' for the unscoped keys; default every tenant)")
		fs.StringVar(&f.State, "state", "", "only completed, failed or processing keys")
		fs.StringVar(&f.KeyPrefix, "key-prefix", "", "only keys that start with this")
		timeVar(fs, &f.Received.Since, "since", "only keys received at or after this time")
		timeVar(fs, &f.Received.Until, "until", "only keys received before this time")
		pageFlags(fs, &p, 100, "rows")
		return func(ctx context.Context, e *env, args []string) error {
			if err := noArgs(args); err != nil {
				return err
			}
			if err := checkLimit(p.Limit); err != nil {
				return err
			}
			f.Tenant = tenant.ptr()
			a, err := e.admin(ctx)
			if err != nil {
				return err
			}
			page, err := a.ListInbox(ctx, f, p)
			if err != nil {
				return usageIfBad(err)
			}
			return writePage(e, listPage[admin.InboxKey]{command: "inbox list", what: "keys", items: page.Rows, next: page.Next},
				"no inbox keys", func() error { return e.inboxTable(page.Rows) })
		}
	},
}

// inboxTable prints inbox keys, one a line.
func (e *env) inboxTable(keys []admin.InboxKey) error {
	tw := e.rowsTable("CONSUMER", "TENANT", "KEY", "STATE", "RECEIVED", "EXPIRES", "ERROR / RESPONSE")
	for _, k := range keys {
		detail := "-"
		switch {
		case k.Response != nil:
			detail = responseSummary(k.Response)
		case k.State == "failed":
			detail = clip(k.ErrorCode+": "+k.Error, 60)
		case k.LeaseUntil != nil:
			detail = "lease until " + ts(k.LeaseUntil)
		}
		e.shardRow(tw, k.Shard, printable(k.Consumer), dash(printable(k.Tenant)), printable(k.Key), k.State, ts(&k.ReceivedAt), ts(&k.ExpiresAt), detail)
	}
	return tw.Flush()
}
