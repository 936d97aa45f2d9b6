package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/user"
	"strings"

	"github.com/spf13/pflag"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/inbox"
)

var forgetCmd = &command{
	name:    "forget",
	args:    "--consumer C --key K [--tenant T] --reason R [--by WHO] [--yes] [flags]",
	summary: "Delete one inbox key, so that its next delivery runs the handler again (dangerous; audited)",
	example: `idem forget --consumer payments --tenant acme --key pay_789 --reason "INC-42: card fixed, charge again"
idem forget --consumer payments --key pay_789 --reason "replay after the fix" --yes --json

DANGEROUS. The inbox key is what makes a redelivery a duplicate. Once it is
forgotten, the next delivery of that message (or retry of that HTTP request)
runs the handler again, and its business work may commit a second time. Use it
for a key recorded as failed whose cause is now fixed, or whose command must run
again on purpose. The effects the first run made stay, with their keys: a re-run
that enqueues the same effects enqueues nothing new.

forget shows the key first, then asks you to type the key on a terminal, or needs
--yes; without either it changes nothing and exits 2 (with --json it never asks,
and the error, code confirmation_required, holds the key and its state). A key that a delivery holds
under a running lease is refused. Every forget is logged on stderr at WARN level
with the key, its state and fingerprint, --by and --reason.`,
	setup: func(fs *pflag.FlagSet) runFunc {
		var o forgetOptions
		fs.StringVar(&o.id.Consumer, "consumer", "", "consumer name, or an HTTP operation such as 'POST /payments' (required)")
		fs.StringVar(&o.id.Key, "key", "", "idempotency key (required)")
		fs.StringVar(&o.id.Tenant, "tenant", "", "tenant scope; empty means none")
		fs.StringVar(&o.audit.Why, "reason", "", "why, for the audit log line: a ticket, a sentence (required)")
		fs.StringVar(&o.audit.Who, "by", defaultWho(), "who, for the audit log line")
		fs.BoolVar(&o.yes, "yes", false, "forget without asking")
		return runWith(&o, runForget)
	},
}

type forgetOptions struct {
	id    inbox.ID
	audit admin.Audit
	yes   bool
}

// defaultWho is the user running idem, at this host.
func defaultWho() string {
	name := os.Getenv("USER")
	if u, err := user.Current(); err == nil && u.Username != "" {
		name = u.Username
	}
	host, _ := os.Hostname()
	if host == "" {
		return name
	}
	return name + "@" + host
}

func runForget(ctx context.Context, e *env, args []string, o forgetOptions) error {
	if err := noArgs(args); err != nil {
		return err
	}
	if o.id.Consumer == "" || o.id.Key == "" {
		return usagef("--consumer and --key are required")
	}
	if strings.TrimSpace(o.audit.Why) == "" {
		return usagef("--reason is required: it goes into the audit log line with --by")
	}
	if err := o.id.Validate(); err != nil {
		return usagef("%v", err)
	}
	a, err := e.admin(ctx)
	if err != nil {
		return err
	}
	rec, err := a.InspectInbox(ctx, o.id, admin.InspectOptions{})
	if errors.Is(err, admin.ErrNotFound) {
		return codedf(admin.ErrNotFound, "no inbox record for %s: nothing to forget", describeID(o.id))
	}
	if err != nil {
		return err
	}
	fmt.Fprintf(e.notes(), "idem forget: %s is %s (received %s, %d effect(s) made).\n"+
		"Forgetting it makes its next delivery run the handler again: the business work may commit a second time.\n",
		describeID(o.id), rec.State, ts(&rec.ReceivedAt), len(rec.Effects))
	what := "the inbox key shown above"
	if e.json {
		what = "the inbox key of the plan"
	}
	plan := map[string]any{"schema": e.schema, "consumer": o.id.Consumer, "tenant": o.id.Tenant, "key": o.id.Key,
		"state": rec.State, "received_at": rec.ReceivedAt, "effects": len(rec.Effects)}
	if err := e.confirmed(question{yes: o.yes,
		refused: confirm(plan, "nothing was changed: forget deletes %s, and its next delivery runs the handler again; to do it, run it again with --yes", what),
		want:    o.id.Key, shown: "the key (" + printable(o.id.Key) + ")", action: "forget it"}); err != nil {
		return err
	}
	k, err := a.Forget(ctx, o.id, o.audit)
	if err != nil {
		return err
	}
	if e.json {
		return e.writeJSON(map[string]any{"schema": e.schema, "forgotten": k, "by": o.audit.Who, "reason": o.audit.Why})
	}
	fmt.Fprintf(e.stdout, "forgot %s (it was %s); its next delivery runs the handler again\n", describeID(o.id), k.State)
	return nil
}

func describeID(id inbox.ID) string {
	if id.Tenant == "" {
		return fmt.Sprintf("inbox key %q of consumer %q", printable(id.Key), printable(id.Consumer))
	}
	return fmt.Sprintf("inbox key %q of consumer %q, tenant %q", printable(id.Key), printable(id.Consumer), printable(id.Tenant))
}
