package admin

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/fanout"
	"github.com/idemkit/idem/internal/inboxdb"
)

// GroupAction names the failures a repair action acts on: those of group ID that
// failed in [Since, Through]. Through is required: pass the LastSeen of the group
// as it was shown, so that a failure that arrived after the operator looked is not
// swept in unseen (Since, when the list was filtered by Seen.Since).
type GroupAction struct {
	ID      string
	Since   time.Time
	Through time.Time
	// DryRun changes nothing and records nothing: the result says what the action
	// would touch now.
	DryRun bool
	// AtMost, when above 0, is the most rows the action may change: pass the Rows
	// of the dry run the operator confirmed. An action that would change more
	// changes nothing and returns ErrGroupChanged. It closes the one gap Through
	// leaves: a failure whose recording transaction began before the look (its
	// time is that transaction's start) and committed after it.
	AtMost int64
	// Note says who asks and why; it is stored with the action, and Why is
	// required unless DryRun.
	Note Audit
}

// ActionResult is what a repair action did, or would do on a dry run.
type ActionResult struct {
	// ActionID is the stored action's ID; empty on a dry run.
	ActionID string    `json:"action_id,omitempty"`
	Action   string    `json:"action"`
	Group    string    `json:"group"`
	DryRun   bool      `json:"dry_run"`
	Since    time.Time `json:"since,omitzero"`
	Through  time.Time `json:"through"`
	// Rows is how many failures it changed (would change, on a dry run).
	Rows int64 `json:"rows"`
	// Keys are the keys it changed, sorted, at most PlanKeys of them.
	Keys []string  `json:"keys"`
	Who  string    `json:"who,omitempty"`
	Why  string    `json:"why,omitempty"`
	At   time.Time `json:"at"`
	// Shards are the rows changed on each shard (an Admin over a shard map); the
	// ActionID is then "shard/id" of each shard's stored action, comma-separated.
	Shards map[string]int64 `json:"shards,omitempty"`
}

// RetryGroup brings the dead effects of an effects group that died in the action's
// range back to pending: attempts from 0, due now, dispatchers notified. Each
// effect is requeued once, however many operators retry the group at once: the
// UPDATE takes only rows that are still dead when it locks them.
func (a *Admin) RetryGroup(ctx context.Context, act GroupAction) (*ActionResult, error) {
	return a.act(ctx, ActionRetry, SourceEffects, act)
}

// DiscardGroup settles the dead effects of an effects group that died in the
// action's range as discarded: never sent, and deleted by the janitor after the
// retention of done effects. An effect that a concurrent retry took is left to it,
// so each effect ends either pending or discarded, never both.
func (a *Admin) DiscardGroup(ctx context.Context, act GroupAction) (*ActionResult, error) {
	return a.act(ctx, ActionDiscard, SourceEffects, act)
}

// ReleaseGroup deletes the failed inbox keys of an inbox group that failed in the
// action's range, so that the next delivery of each, a broker's redelivery or a
// republish (Watermill's requeuer, a NATS or Kafka publish with the same message
// ID), runs its handler again. Use it after the cause is fixed. Effects the failed
// runs enqueued (none, since a failure rolls the handler's work back) are not
// touched. A copy of the message being handled while the key is released commits
// once: the inbox claim settles which copy runs.
func (a *Admin) ReleaseGroup(ctx context.Context, act GroupAction) (*ActionResult, error) {
	return a.act(ctx, ActionRelease, SourceInbox, act)
}

// act runs a repair action on every part. A dry run sums the parts' plans. An
// action runs in one transaction a part, taken one part after the other in map
// order and all left open: when the rows they changed together pass AtMost,
// every one is rolled back (ErrGroupChanged); a shard the group has no row on is
// rolled back too, so that it records no empty action (unless no part changed a
// row: the first part's empty action then stays, the audit that it ran); the
// others commit, one after the other. A shard whose commit fails is named in
// the error, and the result says what the shards before it committed.
func (a *Admin) act(ctx context.Context, action, source string, act GroupAction) (*ActionResult, error) {
	g, err := parseGroupID(act.ID)
	if err != nil {
		return nil, err
	}
	if g.source != source {
		verbs := map[string]string{SourceInbox: "release", SourceEffects: "retry or discard"}
		return nil, errorf(ErrWrongSource, "%s acts on %s groups, and %s is an %s group: %s it", action, source, act.ID, g.source, verbs[g.source])
	}
	if act.Through.IsZero() {
		return nil, errorf(ErrBadFilter, "%s needs Through, the last failure time of the group as it was shown", action)
	}
	act.Note.Who, act.Note.Why = cmp.Or(strings.TrimSpace(act.Note.Who), "unknown"), strings.TrimSpace(act.Note.Why)
	if !act.DryRun && act.Note.Why == "" {
		return nil, errorf(ErrNoteRequired, "%s of group %s: say why in the note", action, act.ID)
	}
	if err := a.offRoute(ctx, action+" of group "+act.ID, func(ctx context.Context, p *part) ([]string, error) {
		if source == SourceInbox {
			return p.tenantsOf(ctx, `SELECT DISTINCT tenant FROM `+p.table("inbox")+` WHERE error_group = $1 AND state = 'failed'`, g.hash)
		}
		return p.tenantsOf(ctx, `SELECT DISTINCT tenant FROM `+p.table("effects")+` WHERE error_group = $1 AND state = 'dead'`, g.hash)
	}); err != nil {
		return nil, err
	}
	type done struct {
		res *ActionResult
		tx  pgx.Tx
	}
	step := func(p *part) (done, error) {
		if act.DryRun {
			r, err := p.act(ctx, p.db, action, g, act)
			return done{res: r}, err
		}
		pool, ok := p.db.(interface {
			Begin(context.Context) (pgx.Tx, error)
		})
		if !ok {
			return done{}, errcode.InvalidConfig("Pool cannot begin a transaction: give a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx")
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			return done{}, p.wrap(err)
		}
		r, err := p.act(ctx, tx, action, g, act)
		if err != nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
			return done{}, err
		}
		return done{res: r, tx: tx}, nil
	}
	var parts []done
	var errs []error
	if act.DryRun {
		parts, errs = fanout.Collect(a.parts, func(_ int, p *part) (done, error) { return step(p) })
	} else {
		// One part after the other, in map order: two actions on a group at once
		// take its rows' locks shard by shard in the same order, so neither holds
		// one shard's rows while it waits for the other's on another shard, a wait
		// that no database would see as a deadlock.
		parts, errs = make([]done, a.parts.Len()), make([]error, a.parts.Len())
		for i, p := range a.parts.Parts() {
			if parts[i], errs[i] = step(p); errs[i] != nil {
				break
			}
		}
	}
	rollback := func(parts []done) {
		for _, p := range parts {
			if p.tx != nil {
				_ = p.tx.Rollback(context.WithoutCancel(ctx))
			}
		}
	}
	if err := a.join(errs); err != nil {
		rollback(parts)
		return nil, err
	}
	out := &ActionResult{Action: action, Group: act.ID, DryRun: act.DryRun, Since: act.Since, Through: act.Through, Keys: []string{}}
	shards := map[string]int64{}
	for i, p := range parts {
		out.Rows += p.res.Rows
		out.Keys = append(out.Keys, p.res.Keys...)
		out.Who, out.Why, out.At = p.res.Who, p.res.Why, maxTime(out.At, p.res.At)
		if name := a.parts.Name(i); p.res.Rows > 0 && name != "" {
			shards[name] = p.res.Rows
		}
	}
	if len(shards) > 0 {
		out.Shards = shards
	}
	if act.AtMost > 0 && out.Rows > act.AtMost {
		rollback(parts)
		return nil, errorf(ErrGroupChanged, "%s of group %s would change more than the %d row(s) planned: failures arrived within the bound since; nothing was changed, look again", action, act.ID, act.AtMost)
	}
	var ids []string
	for i, p := range parts {
		if p.tx == nil {
			continue
		}
		if p.res.Rows == 0 && (out.Rows > 0 || i > 0) {
			_ = p.tx.Rollback(context.WithoutCancel(ctx))
			continue
		}
		if err := p.tx.Commit(ctx); err != nil {
			rollback(parts[i+1:])
			out.ActionID = strings.Join(ids, ",")
			return out, a.partErr(i, fmt.Errorf("commit of the %s failed (the shards before it committed theirs): %w", action, err))
		}
		ids = append(ids, actionID(a.parts.Name(i), p.res.ActionID))
	}
	slices.Sort(out.Keys)
	out.Keys = out.Keys[:min(len(out.Keys), PlanKeys)]
	out.ActionID = strings.Join(ids, ",")
	if !act.DryRun {
		attrs := []slog.Attr{slog.String("schema", a.Schema()), slog.String("group", act.ID), slog.Int64("rows", out.Rows),
			slog.Time("through", act.Through), slog.String("who", out.Who), slog.String("why", out.Why)}
		if len(out.Shards) > 0 {
			attrs = append(attrs, slog.Any("shards", out.Shards))
		}
		a.cfg.Logger.LogAttrs(ctx, slog.LevelWarn, "idem: failure group "+action, attrs...)
	}
	return out, nil
}

// actionID is the ID of an action stored on a shard ("shard/id"), or on one
// database (its own).
func actionID(shard, id string) string {
	if shard == "" {
		return id
	}
	return shard + "/" + id
}

// act runs the statement of a repair action (its plan on a dry run) on db, the
// part's database or a transaction on it; the front has checked the action.
func (a *part) act(ctx context.Context, db inboxdb.DBTX, action string, g groupID, act GroupAction) (*ActionResult, error) {
	var since *time.Time
	if !act.Since.IsZero() {
		since = &act.Since
	}
	out := &ActionResult{Action: action, Group: act.ID, DryRun: act.DryRun, Since: act.Since, Through: act.Through}
	var sql string
	args := []any{g.hash, since, act.Through, PlanKeys}
	if act.DryRun {
		sql = a.q.plan[action]
	} else {
		sql = a.q.act[action]
		args = append(args, act.Note.Who, act.Note.Why)
		if action == ActionRetry {
			args = append(args, a.cfg.Schema) // the dispatchers' wake-up
		}
		out.Who, out.Why = act.Note.Who, act.Note.Why
	}
	var actionID *string
	if err := db.QueryRow(ctx, sql, args...).Scan(&out.Rows, &out.Keys, &out.At, &actionID); err != nil {
		return nil, a.wrap(err)
	}
	if actionID != nil {
		out.ActionID = *actionID
	}
	out.Keys = nonNil(out.Keys)
	return out, nil
}

// FailureAction is one stored repair action: who did what to which group, when,
// why, and how many rows it changed.
type FailureAction struct {
	ID      string    `json:"id"`
	At      time.Time `json:"at"`
	Action  string    `json:"action"`
	Group   string    `json:"group"`
	Source  string    `json:"source"`
	Place   string    `json:"place"`
	Tenant  string    `json:"tenant"`
	Through time.Time `json:"through"`
	Rows    int64     `json:"rows"`
	Who     string    `json:"who"`
	Why     string    `json:"why"`
	// Shard is the shard that stored it (an Admin over a shard map).
	Shard string `json:"shard,omitempty"`
}

// ActionFilter picks stored repair actions; zero fields do not filter.
type ActionFilter struct {
	// Group keeps the actions on that group.
	Group string
	// At filters on when the action was taken.
	At TimeRange
}

// ListActions returns one page of the stored repair actions, newest first: the
// audit trail of retries, discards and releases.
func (a *Admin) ListActions(ctx context.Context, f ActionFilter, p Page) (*List[FailureAction], error) {
	var hash []byte
	if f.Group != "" {
		g, err := parseGroupID(f.Group)
		if err != nil {
			return nil, err
		}
		hash = g.hash
	}
	limit, err := p.limit()
	if err != nil {
		return nil, err
	}
	acts, next, err := fanout.List[*part, FailureAction]{
		Name: "actions",
		Fetch: func(_ int, p *part, limit int, after string) ([]FailureAction, string, error) {
			return p.listActions(ctx, f, hash, limit, after)
		},
		Order: func(x, y FailureAction) int {
			return cmp.Or(cmp.Compare(y.At.UnixMicro(), x.At.UnixMicro()), cmp.Compare(y.ID, x.ID))
		},
		Cursor:    func(x FailureAction) string { return encodeCursor("actions", fmt.Sprint(x.At.UnixMicro()), x.ID, "") },
		BadCursor: badCursor, Join: a.join,
	}.Page(a.parts, p.After, limit)
	if err != nil {
		return nil, err
	}
	return &List[FailureAction]{Rows: acts, Next: next}, nil
}

func (a *part) listActions(ctx context.Context, f ActionFilter, hash []byte, limit int, c string) ([]FailureAction, string, error) {
	after, err := decodeCursor("actions", c)
	if err != nil {
		return nil, "", err
	}
	var afterAt *time.Time
	if c != "" {
		var us int64
		if _, err := fmt.Sscan(after[0], &us); err != nil {
			return nil, "", errorf(ErrBadCursor, "page cursor %q is not one that the actions list returned", clip(c))
		}
		t := time.UnixMicro(us)
		afterAt = &t
	}
	since, until := f.At.args()
	rows, err := a.db.Query(ctx, a.q.listActions, hash, since, until, afterAt, after[1], limit+1)
	if err != nil {
		return nil, "", a.wrap(err)
	}
	acts, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (FailureAction, error) {
		var x FailureAction
		var h []byte
		err := r.Scan(&x.ID, &x.At, &x.Action, &x.Source, &h, &x.Place, &x.Tenant, &x.Through, &x.Rows, &x.Who, &x.Why)
		x.Group = formatGroupID(x.Source, h)
		x.Shard = a.name
		return x, err
	})
	if err != nil {
		return nil, "", a.wrap(err)
	}
	if len(acts) > limit {
		last := acts[limit-1]
		return acts[:limit], encodeCursor("actions", fmt.Sprint(last.At.UnixMicro()), last.ID, ""), nil
	}
	return nonNil(acts), "", nil
}
