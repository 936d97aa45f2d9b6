package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/spf13/pflag"

	"github.com/idemkit/idem/admin"
)

var failuresCmd = &command{
	name:    "failures",
	args:    "[--source inbox|effects] [--consumer C] [--kind K] [--tenant T] [--code CODE] [--since T] [--until T] [--order count|recent] [--limit N] [--after CURSOR] [flags]",
	summary: "List failure groups: failed inbox keys and dead effects grouped by cause",
	example: `idem failures
idem failures --order recent --since 2h
idem failures --consumer payments --tenant acme --json
idem failures --code payment_declined --since 1h

A group is the failures of one consumer (or effect kind) and tenant with the
same error code and the same error text once its variable parts are masked
(numbers, UUIDs, quoted values, hex): most likely one cause. --code keeps the
groups of one error code (exact match, as the CODE column shows it). Act on a group with
'idem failures show|retry|discard|release ID'. --since and --until count only
the failures in that time (a time, a date, or an age such as 90m or 7d). Over a
shard map a group is one row, its shards' failures summed; SHARD names the
shards that hold it, and 'idem failures show ID' shows each one's part.`,
	setup: func(fs *pflag.FlagSet) runFunc {
		var o failuresListOptions
		fs.StringVar(&o.f.Source, "source", "", "inbox (failed keys) or effects (dead effects); default both")
		fs.StringVar(&o.f.Consumer, "consumer", "", "only this consumer's inbox groups")
		fs.StringVar(&o.f.Kind, "kind", "", "only this kind's effects groups")
		fs.Var(&o.tenant, "tenant", "only this tenant ('' for the unscoped; default every tenant)")
		fs.StringVar(&o.f.Code, "code", "", "only the groups of this error code, such as payment_declined (exact match)")
		timeVar(fs, &o.f.Seen.Since, "since", "count only failures at or after this time")
		timeVar(fs, &o.f.Seen.Until, "until", "count only failures before this time")
		fs.StringVar(&o.f.Order, "order", admin.ByCount, "count (largest first) or recent (latest failure first)")
		pageFlags(fs, &o.p, 50, "groups")
		return runWith(&o, runFailuresList)
	},
}

type failuresListOptions struct {
	f      admin.GroupFilter
	p      admin.Page
	tenant optString
}

func runFailuresList(ctx context.Context, e *env, args []string, o failuresListOptions) error {
	if len(args) > 0 {
		return usagef("takes no arguments, got %q; to see one group: idem failures show ID", args)
	}
	if err := checkLimit(o.p.Limit); err != nil {
		return err
	}
	o.f.Tenant = o.tenant.ptr()
	a, err := e.admin(ctx)
	if err != nil {
		return err
	}
	page, err := a.ListGroups(ctx, o.f, o.p)
	if err != nil {
		return usageIfBad(err)
	}
	return writePage(e, listPage[admin.FailureGroup]{command: "failures", what: "groups", items: page.Rows, next: page.Next},
		"no failures: no failed inbox keys and no dead effects", func() error {
			tw := e.rowsTable("ID", "SOURCE", "CONSUMER/KIND", "TENANT", "CODE", "COUNT", "LAST SEEN", "ERROR (MASKED)")
			for _, g := range page.Rows {
				e.shardRow(tw, g.Shard, g.ID, g.Source, clip(g.Place(), 24), clip(g.Tenant, 12), clip(g.Code, 20), g.Count, ts(&g.LastSeen), clip(g.Masked, 60))
			}
			if err := tw.Flush(); err != nil {
				return err
			}
			fmt.Fprintln(e.stdout, "\nShow one: idem failures show ID; then retry or discard (effects) or release (inbox keys) it.")
			return nil
		})
}

var failuresShowCmd = &command{
	name:    "failures show",
	args:    "ID [--since T] [--until T] [flags]",
	summary: "Show one failure group: counts, sample keys, an example error, attempts, and the actions taken",
	example: `idem failures show e-3fa2c0d1e2f3a4b5
idem failures show i-0c1d2e3f4a5b6c7d --json`,
	setup: func(fs *pflag.FlagSet) runFunc {
		var seen admin.TimeRange
		timeVar(fs, &seen.Since, "since", "count only failures at or after this time")
		timeVar(fs, &seen.Until, "until", "count only failures before this time")
		return runWith(&seen, runFailuresShow)
	},
}

func oneID(args []string) (string, error) {
	if len(args) != 1 {
		return "", usagef("takes one failure group ID (from 'idem failures'), got %d arguments", len(args))
	}
	return args[0], nil
}

func runFailuresShow(ctx context.Context, e *env, args []string, seen admin.TimeRange) error {
	id, err := oneID(args)
	if err != nil {
		return err
	}
	a, err := e.admin(ctx)
	if err != nil {
		return err
	}
	g, err := a.Group(ctx, id, seen)
	if errors.Is(err, admin.ErrNotFound) {
		// An empty group may still have its audit trail: show it.
		acts, aerr := a.ListActions(ctx, admin.ActionFilter{Group: id}, admin.Page{Limit: 20})
		if aerr == nil && len(acts.Rows) > 0 {
			if e.json {
				return e.writeJSON(map[string]any{"id": id, "count": 0, "actions": acts.Rows})
			}
			fmt.Fprintf(e.stdout, "Group %s holds no failures now.\n", id)
			e.actionsTable(acts.Rows)
			return nil
		}
	}
	if err != nil {
		return usageIfBad(err)
	}
	if e.json {
		return e.writeJSON(g)
	}
	w := e.stdout
	place := "Consumer"
	if g.Source == admin.SourceEffects {
		place = "Kind"
	}
	fmt.Fprintf(w, "Group       %s (%s)\n%-11s %s\nTenant      %s\nCode        %s\nCount       %d\nFirst seen  %s\nLast seen   %s\n",
		g.ID, g.Source, place, printable(g.Place()), dash(printable(g.Tenant)), dash(printable(g.Code)), g.Count, ts(&g.FirstSeen), ts(&g.LastSeen))
	if len(g.Parts) > 0 {
		fmt.Fprintf(w, "\nShards:\n")
		tw := e.table("  SHARD", "COUNT", "FIRST SEEN", "LAST SEEN")
		for _, p := range g.Parts {
			row(tw, "  "+printable(p.Shard), p.Count, ts(&p.FirstSeen), ts(&p.LastSeen))
		}
		_ = tw.Flush()
	}
	fmt.Fprintf(w, "\nError (masked):\n  %s\nExample (newest, whole):\n  %s\n", printable(g.Masked), printable(g.Example))
	fmt.Fprintf(w, "\nSample keys (newest first):\n")
	for _, k := range g.SampleKeys[:min(len(g.SampleKeys), textPlanKeys)] {
		fmt.Fprintf(w, "  %s\n", printable(k))
	}
	if len(g.Attempts) > 0 {
		fmt.Fprintf(w, "\nAttempts made:\n")
		for _, x := range g.Attempts {
			fmt.Fprintf(w, "  %d attempt(s): %d effect(s)\n", x.Attempts, x.Effects)
		}
	}
	if len(g.Actions) > 0 {
		fmt.Fprintln(w)
		e.actionsTable(g.Actions)
	}
	verbs := "retry (back to pending) or discard (never sent)"
	if g.Source == admin.SourceInbox {
		verbs = "release (the next delivery or a republish runs the handler again)"
	}
	fmt.Fprintf(w, "\nNext: idem failures %s %s --dry-run, then without --dry-run and with --note.\n", strings.Fields(verbs)[0], g.ID)
	fmt.Fprintf(w, "(%s)\n", verbs)
	return nil
}

func (e *env) actionsTable(acts []admin.FailureAction) {
	fmt.Fprintln(e.stdout, "Actions taken (newest first):")
	tw := e.table("  AT", "ACTION", "ROWS", "THROUGH", "BY", "NOTE")
	for _, x := range acts {
		row(tw, "  "+ts(&x.At), x.Action, x.Rows, ts(&x.Through), clip(x.Who, 24), clip(x.Why, 60))
	}
	_ = tw.Flush()
}

// failureAction is one of the three repair actions.
type failureAction struct {
	verb    string // admin.ActionRetry, admin.ActionDiscard or admin.ActionRelease
	do      func(*admin.Admin, context.Context, admin.GroupAction) (*admin.ActionResult, error)
	doing   string // for the plan: "requeue N dead effects"
	outcome string // for the result
}

// failureActions are the repair actions of the failures commands and the
// console's Failures page, by verb.
var failureActions = map[string]failureAction{
	admin.ActionRetry: {do: (*admin.Admin).RetryGroup,
		doing:   "requeue %d dead effect(s): back to pending with their attempts reset, due now",
		outcome: "requeued %d dead effect(s); dispatchers were notified and will send them now"},
	admin.ActionDiscard: {do: (*admin.Admin).DiscardGroup,
		doing:   "discard %d dead effect(s): never sent, deleted by the janitor after the effects retention",
		outcome: "discarded %d dead effect(s); they will never be sent"},
	admin.ActionRelease: {do: (*admin.Admin).ReleaseGroup,
		doing:   "release %d failed inbox key(s): the next delivery or a republish of each runs the handler again",
		outcome: "released %d failed inbox key(s); their next delivery (or a republish from the poison topic) runs the handler again"},
}

// failureActionFor is the repair action named verb; false for none.
func failureActionFor(verb string) (failureAction, bool) {
	fa, ok := failureActions[verb]
	fa.verb = verb
	return fa, ok
}

func failureActionCmd(verb, summary, example string) *command {
	fa, _ := failureActionFor(verb)
	return &command{
		name:    "failures " + fa.verb,
		args:    "ID --note WHY [--by WHO] [--through T] [--since T] [--dry-run] [--yes] [flags]",
		summary: summary,
		example: example + `

The action takes only the group's failures up to --through (default: the
group's last failure as it reads now, shown in the plan), so failures that
arrive after you looked are not swept in. It shows its plan first (how many,
and which keys), then asks you to type yes on a terminal, or needs --yes;
with --json it never asks, and without --yes fails with code
confirmation_required and the plan in the error object. --dry-run shows the
plan and changes nothing. --note (why) and --by (who) are stored with the
action: 'idem failures show ID' lists them. Repeating an action changes
nothing more.`,
		setup: func(fs *pflag.FlagSet) runFunc {
			var o failureActionOptions
			fs.StringVar(&o.act.Note.Why, "note", "", "why, stored with the action: a ticket, a sentence (required unless --dry-run)")
			fs.StringVar(&o.act.Note.Who, "by", defaultWho(), "who, stored with the action")
			timeVar(fs, &o.act.Through, "through", "act only on failures up to this time (default: the group's last failure now)")
			timeVar(fs, &o.act.Since, "since", "act only on failures at or after this time")
			fs.BoolVar(&o.act.DryRun, "dry-run", false, "show what it would touch; change nothing")
			fs.BoolVar(&o.yes, "yes", false, "act without asking")
			return func(ctx context.Context, e *env, args []string) error {
				return runFailureAction(ctx, e, args, fa, o)
			}
		},
	}
}

type failureActionOptions struct {
	act admin.GroupAction
	yes bool
}

var failuresRetryCmd = failureActionCmd(admin.ActionRetry, "Retry a group of dead effects: back to pending with their attempts reset (audited)",
	`idem failures retry e-3fa2c0d1e2f3a4b5 --dry-run
idem failures retry e-3fa2c0d1e2f3a4b5 --note "INC-42: provider fixed the shape check"
idem failures retry e-3fa2c0d1e2f3a4b5 --note "INC-42" --yes --json`)

var failuresDiscardCmd = failureActionCmd(admin.ActionDiscard, "Discard a group of dead effects: settled, never sent (audited)",
	`idem failures discard e-3fa2c0d1e2f3a4b5 --dry-run
idem failures discard e-3fa2c0d1e2f3a4b5 --note "obsolete: the campaign was cancelled"`)

var failuresReleaseCmd = failureActionCmd(admin.ActionRelease, "Release a group of failed inbox keys, so that their next delivery or a republish runs again (audited)",
	`idem failures release i-0c1d2e3f4a5b6c7d --dry-run
idem failures release i-0c1d2e3f4a5b6c7d --note "deploy 512 fixed the decimal parser"

Release after the fix is deployed; then republish the messages (Watermill's
requeuer on the poison topic, or a publish with the same message IDs). A copy
of a message being handled while its key is released commits once.`)

func runFailureAction(ctx context.Context, e *env, args []string, fa failureAction, o failureActionOptions) error {
	id, err := oneID(args)
	if err != nil {
		return err
	}
	o.act.ID = id
	if !o.act.DryRun && strings.TrimSpace(o.act.Note.Why) == "" {
		return usagef("--note is required: say why, it is stored with the action (or use --dry-run)")
	}
	a, err := e.admin(ctx)
	if err != nil {
		return err
	}
	// again is what a re-run adds to act on the set planned here: --yes, and the
	// plan's bound (and the ages given, as times), so that failures arriving
	// between the two runs stay out.
	again := append([]string{"--yes"}, e.pinned...)
	if o.act.Through.IsZero() {
		g, err := a.Group(ctx, id, admin.TimeRange{Since: o.act.Since})
		if errors.Is(err, admin.ErrNotFound) {
			return nothingLeft(ctx, e, a, fa, id)
		}
		if err != nil {
			return usageIfBad(err)
		}
		o.act.Through = g.LastSeen
		again = append(again, "--through", g.LastSeen.UTC().Format(time.RFC3339Nano))
	}
	dry := o.act
	dry.DryRun = true
	plan, err := fa.do(a, ctx, dry)
	if err != nil {
		return usageIfBad(err)
	}
	if o.act.DryRun {
		if e.json {
			return e.writeJSON(plan)
		}
		e.printPlan(fa, plan, "would ")
		return nil
	}
	if plan.Rows == 0 {
		if e.json {
			return e.writeJSON(plan)
		}
		fmt.Fprintf(e.stdout, "group %s has no failures up to %s: nothing to %s\n", id, ts(&plan.Through), fa.verb)
		return nil
	}
	if !e.json {
		e.printPlanTo(e.stderr, fa, plan, "will ")
	}
	if err := e.confirmed(question{yes: o.yes,
		refused: confirm(plan, "nothing was changed: %s would change %d row(s) of group %s; to do it, run it again with %s", fa.verb, plan.Rows, id, strings.Join(again, " ")),
		want:    "yes", shown: "yes", action: fmt.Sprintf("%s these %d row(s)", fa.verb, plan.Rows)}); err != nil {
		return err
	}
	o.act.AtMost = plan.Rows // exactly what was shown and confirmed, or nothing
	res, err := fa.do(a, ctx, o.act)
	if err != nil {
		return usageIfBad(err)
	}
	if e.json {
		return e.writeJSON(res)
	}
	fmt.Fprintf(e.stdout, fa.outcome+" (group %s, action %s)\n", res.Rows, id, res.ActionID)
	if res.Rows < plan.Rows { // never more: AtMost
		fmt.Fprintf(e.stdout, "(%d of the planned rows had changed meanwhile: another operator, or a dispatcher, took them)\n", plan.Rows-res.Rows)
	}
	return nil
}

// nothingLeft answers an action on a group that holds no failures now: done
// before (its audit trail says so; repeating changes nothing), or no such group.
func nothingLeft(ctx context.Context, e *env, a *admin.Admin, fa failureAction, id string) error {
	acts, err := a.ListActions(ctx, admin.ActionFilter{Group: id}, admin.Page{Limit: 1})
	if err != nil {
		return usageIfBad(err)
	}
	if len(acts.Rows) == 0 {
		return codedf(admin.ErrNotFound, "no failures in group %s, and no action was ever taken on it: check the ID with 'idem failures'", id)
	}
	last := acts.Rows[0]
	if e.json {
		return e.writeJSON(admin.ActionResult{Action: fa.verb, Group: id, Keys: []string{}, At: time.Now().UTC()})
	}
	fmt.Fprintf(e.stdout, "group %s holds no failures now (last action: %s of %d row(s) by %s at %s): nothing to %s\n",
		id, last.Action, last.Rows, printable(last.Who), ts(&last.At), fa.verb)
	return nil
}

// textPlanKeys is how many keys a plan names on a terminal.
const textPlanKeys = 10

func (e *env) printPlan(fa failureAction, p *admin.ActionResult, mood string) {
	e.printPlanTo(e.stdout, fa, p, mood)
}

func (e *env) printPlanTo(w interface{ Write([]byte) (int, error) }, fa failureAction, p *admin.ActionResult, mood string) {
	since := ""
	if !p.Since.IsZero() {
		since = " from " + ts(&p.Since)
	}
	fmt.Fprintf(w, "idem failures %s %s %s"+fa.doing+",\nthe group's failures%s up to %s (--through %s)",
		fa.verb, p.Group, mood, p.Rows, since, ts(&p.Through), p.Through.UTC().Format(time.RFC3339Nano))
	if len(p.Keys) > 0 {
		// A terminal gets the first few (--json has PlanKeys of them).
		shown := p.Keys[:min(len(p.Keys), textPlanKeys)]
		more := ""
		if int64(len(shown)) < p.Rows {
			more = fmt.Sprintf(", and %d more", p.Rows-int64(len(shown)))
		}
		keys := make([]string, len(shown))
		for i, k := range shown {
			keys[i] = printable(k)
		}
		fmt.Fprintf(w, ":\n  %s%s", strings.Join(keys, ", "), more)
	}
	fmt.Fprintln(w)
}
