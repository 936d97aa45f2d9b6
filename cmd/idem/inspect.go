package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/spf13/pflag"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/inbox"
)

var inspectCmd = &command{
	name:    "inspect",
	args:    "--consumer C --key K [--tenant T] [--show-body] [flags]",
	summary: "Show one inbox record (state, fingerprint, times, error, stored HTTP response) and the effects it made",
	example: `idem inspect --consumer payments --key pay_789
idem inspect --consumer payments --tenant acme --key pay_789 --json
idem inspect --consumer 'POST /payments' --tenant acct_42 --key 0b6f3c52-7a4e-4d8e-9d0c-4f6a1f7e2b11

An HTTP key's stored response shows its status, header names and body size; the
body itself (it may hold personal data) only with --show-body.
Without --consumer, 'idem find --key K' looks the key up in every consumer.`,
	setup: func(fs *pflag.FlagSet) runFunc {
		var id inbox.ID
		var body bool
		fs.StringVar(&id.Consumer, "consumer", "", "consumer name, or an HTTP operation such as 'POST /payments' (required)")
		fs.StringVar(&id.Key, "key", "", "idempotency key (required)")
		fs.StringVar(&id.Tenant, "tenant", "", "tenant scope; empty means none")
		fs.BoolVar(&body, "show-body", false, "also show a stored HTTP response's body")
		return func(ctx context.Context, e *env, args []string) error {
			return runInspect(ctx, e, args, id, body)
		}
	},
}

func runInspect(ctx context.Context, e *env, args []string, id inbox.ID, body bool) error {
	if err := noArgs(args); err != nil {
		return err
	}
	if id.Consumer == "" || id.Key == "" {
		return usagef("--consumer and --key are required (to look a key up in every consumer: idem find --key K)")
	}
	if err := id.Validate(); err != nil {
		return usagef("%v", err)
	}
	a, err := e.admin(ctx)
	if err != nil {
		return err
	}
	rec, err := a.InspectInbox(ctx, id, admin.InspectOptions{Body: body})
	if errors.Is(err, admin.ErrNotFound) {
		tenant := ""
		if id.Tenant != "" {
			tenant = fmt.Sprintf(" tenant %q", id.Tenant)
		}
		return codedf(admin.ErrNotFound, "no inbox record for consumer %q%s key %q.\n"+
			"Either no delivery of it committed or failed permanently (a transient failure records nothing),\n"+
			"or its retention ended and the janitor deleted it. Check --consumer, --tenant and --key\n"+
			"('idem find --key %s' looks in every consumer and tenant)", id.Consumer, tenant, id.Key, shellQuote(id.Key))
	}
	if err != nil {
		return err
	}
	if e.json {
		return e.writeJSON(rec)
	}
	e.inboxKeyTable(&rec.InboxKey)
	fmt.Fprintf(e.stdout, "\nEffects made by this message: %d\n", len(rec.Effects))
	if len(rec.Effects) == 0 {
		return nil
	}
	return e.effectsTable(rec.Effects)
}

// inboxKeyTable prints one inbox key as FIELD/VALUE rows.
func (e *env) inboxKeyTable(k *admin.InboxKey) {
	tw := e.table("FIELD", "VALUE")
	row(tw, "consumer", printable(k.Consumer))
	row(tw, "tenant", dash(printable(k.Tenant)))
	row(tw, "key", printable(k.Key))
	row(tw, "state", k.State)
	row(tw, "fingerprint", k.Fingerprint)
	row(tw, "attempts", k.Attempts)
	row(tw, "received_at", ts(&k.ReceivedAt)+" ("+age(k.Now.Sub(k.ReceivedAt))+" ago)")
	row(tw, "completed_at", ts(k.CompletedAt))
	row(tw, "expires_at", ts(&k.ExpiresAt)+" (in "+age(k.ExpiresAt.Sub(k.Now))+")")
	if k.State == string(inbox.StateFailed) {
		row(tw, "error_code", dash(k.ErrorCode))
		row(tw, "error", clip(k.Error, 200))
	}
	if k.LeaseUntil != nil {
		row(tw, "lease_until", ts(k.LeaseUntil))
		row(tw, "fence", k.Fence)
	}
	if r := k.Response; r != nil {
		row(tw, "response", responseSummary(r))
		if r.Body != nil {
			row(tw, "response_body", clip(strconv.Quote(string(r.Body)), 2000))
		}
	}
	_ = tw.Flush()
}

func responseSummary(r *admin.Response) string {
	body := fmt.Sprintf("%d bytes", r.BodyBytes)
	if r.BodyRef != "" {
		body = "by reference " + printable(r.BodyRef)
	}
	return fmt.Sprintf("%d, body %s, headers %s", r.Status, body, dash(printable(strings.Join(r.HeaderNames(), ", "))))
}

// effectsTable prints effects as a table: inspect, find and effects list share it.
func (e *env) effectsTable(effs []admin.Effect) error {
	tw := e.rowsTable("TENANT", "KIND", "KEY", "STATE", "ATTEMPTS", "CREATED", "NEXT ATTEMPT / DONE", "LAST ERROR")
	for _, x := range effs {
		when := ts(&x.NextAttemptAt)
		switch x.State {
		case "done":
			when = ts(x.DoneAt)
		case "dead":
			when = "-"
		}
		e.shardRow(tw, x.Shard, dash(printable(x.Tenant)), x.Kind, printable(x.Key), x.State, fmt.Sprintf("%d/%d", x.Attempts, x.MaxAttempts),
			ts(&x.CreatedAt), when, clip(x.LastError, 60))
	}
	return tw.Flush()
}

// shellQuote quotes s for a command line to copy, when it needs it.
func shellQuote(s string) string {
	if s != "" && strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.:/@+=,") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
