package admin

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/text"
)

// Moving a tenant from one shard to another (see docs/sharding.md): drain the
// tenant (stop its consumers and HTTP handlers, or route it nowhere), copy its rows
// with MoveTenant, switch the route (a Table entry), and resume. Without the copy
// the new shard has none of the tenant's inbox keys, so a redelivery of a message
// the old shard recorded runs its handler again, and the old shard's pending
// effects are sent from there while the new shard knows nothing of them.

// DefaultMoveRetention is how far back MoveTenant copies done effects (the
// janitor's default retention of done effects).
const DefaultMoveRetention = 7 * 24 * time.Hour

var (
	// ErrNotDrained is returned, and nothing was changed on either shard, when the
	// tenant is still being worked on its old shard: an inbox key processing under
	// a running lease, or an effect being sent. Drain the tenant and run it again.
	ErrNotDrained = errcode.Transient("not_drained", "the tenant is still being worked on its old shard: drain it first")
	// ErrSchemaDiffers is returned when the two shards' inbox or effects tables do
	// not have the same columns: migrate both to the same version first.
	ErrSchemaDiffers = errcode.Permanent("schema_differs", "the shards' idem tables differ: migrate both to the same version")
)

// parked is how far in the future MoveTenant pushes the due time of a pending
// effect it hands over: no dispatcher claims it there, and the copy on the new
// shard gets its due time back by subtracting it.
const (
	parked      = "interval '1000 years'"
	parkedAbove = "now() + interval '500 years'"
)

// MoveTenant says which tenant moves where.
type MoveTenant struct {
	Tenant string
	// From is the shard the tenant's rows are on (default: the one the map's route
	// gives now, before the route is switched).
	From string
	// To is its new shard. Required.
	To string
	// EffectsRetention: done effects done within it are copied (0:
	// DefaultMoveRetention). Inbox keys are copied until they expire, pending, dead
	// and discarded effects always.
	EffectsRetention time.Duration
	// DryRun counts what would be copied and changes nothing.
	DryRun bool
}

// MoveResult is a move's plan (counted on the old shard) and what the copy did.
type MoveResult struct {
	Tenant string `json:"tenant"`
	From   string `json:"from"`
	To     string `json:"to"`
	DryRun bool   `json:"dry_run"`
	// InboxKeys are the tenant's inbox keys on the old shard that have not
	// expired, by state.
	InboxKeys map[string]int64 `json:"inbox_keys"`
	// Effects are its effects on the old shard to copy, by state.
	Effects map[string]int64 `json:"effects"`
	// Busy counts what keeps the tenant from being drained: keys processing under
	// a running lease, and effects being sent. A move is refused while it is not 0.
	Busy int64 `json:"busy"`
	// InboxCopied and EffectsCopied are the rows the copy inserted on the new
	// shard (rows already there are left as they are).
	InboxCopied   int64 `json:"inbox_copied"`
	EffectsCopied int64 `json:"effects_copied"`
	// HandedOver are the pending effects deleted from the old shard once their
	// copies were on the new one, so that they are sent from there alone.
	HandedOver int64 `json:"handed_over"`
}

// moveBatch is how many rows one copy statement carries.
const moveBatch = 500

// MoveTenant copies a drained tenant's inbox keys (until they expire) and effects
// (pending, dead, discarded, and done within the retention) from its old shard to
// its new one, so that after the route is switched its redeliveries are
// recognised as duplicates and its pending effects are sent once, from the new
// shard. It needs an Admin over a shard map.
//
// Pending effects are handed over without a moment where both shards would send
// them: they are first parked on the old shard (due far in the future, in one
// transaction that also checks the tenant is drained), then copied with their due
// times back, then deleted from the old shard. Every step is idempotent, so a move
// that failed half-way is finished by running it again; a row already on the new
// shard is kept as it is. The old shard's other copies stay until the janitor
// deletes them.
func (a *Admin) MoveTenant(ctx context.Context, mv MoveTenant) (*MoveResult, error) {
	if a.shards == nil {
		return nil, errorf(ErrBadFilter, "moving a tenant needs an Admin over a shard map (Config.Shards)")
	}
	if !text.Storable(mv.Tenant) {
		// Postgres text never holds it, so no shard has rows of it.
		return nil, errorf(ErrBadFilter, "tenant %q: not valid UTF-8 text without NUL bytes, so no shard has rows of it", clip(mv.Tenant))
	}
	if mv.From == "" {
		s, err := a.cfg.Shards.Pick(mv.Tenant)
		if err != nil {
			return nil, err
		}
		mv.From = s.Name
	}
	from, to := a.shardNamed(mv.From), a.shardNamed(mv.To)
	switch {
	case from == nil:
		return nil, errorf(ErrBadFilter, "move from %q: not a shard of the map (%v)", mv.From, a.names())
	case to == nil:
		return nil, errorf(ErrBadFilter, "move to %q: not a shard of the map (%v)", mv.To, a.names())
	case from == to:
		return nil, errorf(ErrBadFilter, "tenant %q: from and to are the same shard %q", mv.Tenant, mv.From)
	}
	retention := cmp.Or(mv.EffectsRetention, DefaultMoveRetention)
	if err := sameColumns(ctx, from, to); err != nil {
		return nil, err
	}
	out := &MoveResult{Tenant: mv.Tenant, From: mv.From, To: mv.To, DryRun: mv.DryRun}
	if err := from.movePlan(ctx, mv.Tenant, retention, out); err != nil {
		return nil, &ShardError{Shard: from.name, Err: err}
	}
	if mv.DryRun {
		return out, nil
	}
	if out.Busy > 0 {
		return out, errorf(ErrNotDrained, "tenant %q on shard %q: %d inbox key(s) processing under a lease or effect(s) being sent; drain the tenant and move it again", mv.Tenant, mv.From, out.Busy)
	}
	if err := from.park(ctx, mv.Tenant); err != nil {
		return out, err
	}
	moveStep("parked")
	t := func(s *Admin, name string) string { return pgx.Identifier{s.cfg.Schema, name}.Sanitize() }
	n, err := copyRows(ctx, from, to, mv.Tenant, "inbox", "consumer", "key",
		`i.expires_at > now()`, nil)
	out.InboxCopied = n
	if err != nil {
		return out, err
	}
	moveStep("inbox_copied")
	n, err = copyRows(ctx, from, to, mv.Tenant, "effects", "kind", "key",
		`(i.state <> 'done' OR i.done_at > now() - $4::interval)`, []any{retention})
	out.EffectsCopied = n
	if err != nil {
		return out, err
	}
	moveStep("effects_copied")
	// Every parked effect is on the new shard now: give it its due time back
	// there (a copy that was already there is not parked), then hand it over.
	// The new shard's dispatchers are woken up (the copy's INSERT does not).
	if _, err := to.db.Exec(ctx, `WITH back AS (
			UPDATE `+t(to, "effects")+` SET next_attempt_at = next_attempt_at - `+parked+`
			WHERE tenant = $1 AND state = 'pending' AND next_attempt_at > `+parkedAbove+`
			RETURNING 1)
		SELECT count(*), pg_notify('idem_effects', $2) FROM back`, mv.Tenant, to.cfg.Schema); err != nil {
		return out, &ShardError{Shard: to.name, Err: to.wrap(err)}
	}
	moveStep("handed_back")
	tag, err := from.db.Exec(ctx, `DELETE FROM `+t(from, "effects")+`
		WHERE tenant = $1 AND state = 'pending' AND next_attempt_at > `+parkedAbove, mv.Tenant)
	if err != nil {
		return out, &ShardError{Shard: from.name, Err: from.wrap(err)}
	}
	out.HandedOver = tag.RowsAffected()
	a.cfg.Logger.LogAttrs(ctx, slog.LevelWarn, "idem: tenant copied to its new shard; switch its route now",
		slog.String("tenant", mv.Tenant), slog.String("from", mv.From), slog.String("to", mv.To),
		slog.Int64("inbox_copied", out.InboxCopied), slog.Int64("effects_copied", out.EffectsCopied),
		slog.Int64("handed_over", out.HandedOver))
	return out, nil
}

// moveStep is called after each step of MoveTenant that has committed, with its
// name. It does nothing; the crash tests set it to kill the process there.
var moveStep = func(string) {}

func (a *Admin) shardNamed(name string) *Admin {
	for _, s := range a.shards {
		if s.name == name {
			return s
		}
	}
	return nil
}

// busyWhere: what keeps a tenant from being drained.
const (
	busyInbox   = `state = 'processing' AND lease_until > now()`
	busyEffects = `state = 'pending' AND in_flight AND next_attempt_at > now() AND next_attempt_at <= ` + parkedAbove
)

func (a *Admin) movePlan(ctx context.Context, tenant string, retention time.Duration, out *MoveResult) error {
	t := func(name string) string { return pgx.Identifier{a.cfg.Schema, name}.Sanitize() }
	out.InboxKeys, out.Effects = map[string]int64{}, map[string]int64{}
	rows, err := a.db.Query(ctx, `SELECT 'inbox', state, count(*), count(*) FILTER (WHERE `+busyInbox+`)
			FROM `+t("inbox")+` WHERE tenant = $1 AND expires_at > now() GROUP BY state
		UNION ALL
		SELECT 'effects', state, count(*), count(*) FILTER (WHERE `+busyEffects+`)
			FROM `+t("effects")+` WHERE tenant = $1 AND (state <> 'done' OR done_at > now() - $2::interval) GROUP BY state`,
		tenant, retention)
	if err != nil {
		return a.wrap(err)
	}
	var table, state string
	var n, busy int64
	_, err = pgx.ForEachRow(rows, []any{&table, &state, &n, &busy}, func() error {
		if table == "inbox" {
			out.InboxKeys[state] = n
		} else {
			out.Effects[state] = n
		}
		out.Busy += busy
		return nil
	})
	return a.wrap(err)
}

// park pushes the tenant's pending effects far into the future, in one
// transaction that refuses (ErrNotDrained, nothing changed) if any is being sent
// or any inbox key is processing under a lease. A parked effect is never claimed.
func (a *Admin) park(ctx context.Context, tenant string) error {
	t := func(name string) string { return pgx.Identifier{a.cfg.Schema, name}.Sanitize() }
	db, ok := a.db.(interface {
		Begin(context.Context) (pgx.Tx, error)
	})
	if !ok {
		return errcode.InvalidConfig("shard %q: its pool cannot begin a transaction", a.name)
	}
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `UPDATE `+t("effects")+` SET next_attempt_at = next_attempt_at + `+parked+`
			WHERE tenant = $1 AND state = 'pending' AND next_attempt_at <= `+parkedAbove+`
				AND NOT (in_flight AND next_attempt_at > now())`, tenant); err != nil {
			return err
		}
		var busy int64
		if err := tx.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+t("effects")+` WHERE tenant = $1 AND `+busyEffects+`)
			+ (SELECT count(*) FROM `+t("inbox")+` WHERE tenant = $1 AND `+busyInbox+`)`, tenant).Scan(&busy); err != nil {
			return err
		}
		if busy > 0 {
			return errorf(ErrNotDrained, "tenant %q on shard %q: %d inbox key(s) processing under a lease or effect(s) being sent; drain the tenant and move it again", tenant, a.name, busy)
		}
		return nil
	})
	if err != nil && errcode.Code(err) == "" {
		return &ShardError{Shard: a.name, Err: a.wrap(err)}
	}
	return err
}

// copyRows copies the tenant's rows of table that match where from one shard to
// the other, moveBatch at a time in primary key order, as JSON records of the
// whole row (so every column a migration added goes too); a row already on the
// new shard is left as it is. It returns how many rows it inserted.
func copyRows(ctx context.Context, from, to *Admin, tenant, table, k1, k2, where string, extra []any) (int64, error) {
	src := pgx.Identifier{from.cfg.Schema, table}.Sanitize()
	dst := pgx.Identifier{to.cfg.Schema, table}.Sanitize()
	var copied int64
	a1, a2 := "", ""
	for {
		rows, err := from.db.Query(ctx, `SELECT to_jsonb(i), i.`+k1+`, i.`+k2+` FROM `+src+` i
			WHERE i.tenant = $1 AND (i.`+k1+`, i.`+k2+`) > ($2, $3) AND `+where+`
			ORDER BY i.`+k1+`, i.`+k2+` LIMIT `+fmt.Sprint(moveBatch), append([]any{tenant, a1, a2}, extra...)...)
		if err != nil {
			return copied, &ShardError{Shard: from.name, Err: from.wrap(err)}
		}
		var batch []json.RawMessage
		var rec json.RawMessage
		_, err = pgx.ForEachRow(rows, []any{&rec, &a1, &a2}, func() error {
			batch = append(batch, slices.Clone(rec))
			return nil
		})
		if err != nil {
			return copied, &ShardError{Shard: from.name, Err: from.wrap(err)}
		}
		if len(batch) == 0 {
			return copied, nil
		}
		b, _ := json.Marshal(batch)
		tag, err := to.db.Exec(ctx, `INSERT INTO `+dst+` SELECT * FROM jsonb_populate_recordset(NULL::`+dst+`, $1::jsonb)
			ON CONFLICT DO NOTHING`, string(b))
		if err != nil {
			return copied, &ShardError{Shard: to.name, Err: to.wrap(err)}
		}
		copied += tag.RowsAffected()
		if len(batch) < moveBatch {
			return copied, nil
		}
	}
}

// sameColumns refuses a move between shards whose inbox or effects tables differ.
func sameColumns(ctx context.Context, from, to *Admin) error {
	cols := func(s *Admin) (string, error) {
		var c string
		err := s.db.QueryRow(ctx, `SELECT coalesce(string_agg(table_name || '.' || column_name || ' ' || data_type, ', ' ORDER BY table_name, column_name), '')
			FROM information_schema.columns WHERE table_schema = $1 AND table_name IN ('inbox', 'effects')`, s.cfg.Schema).Scan(&c)
		if err != nil {
			return "", &ShardError{Shard: s.name, Err: s.wrap(err)}
		}
		return c, nil
	}
	f, err := cols(from)
	if err != nil {
		return err
	}
	t, err := cols(to)
	if err != nil {
		return err
	}
	if f == "" || f != t {
		return errorf(ErrSchemaDiffers, "shards %q and %q: the inbox and effects tables of schemas %q and %q differ (or are missing): run idem migrate up on both", from.name, to.name, from.cfg.Schema, to.cfg.Schema)
	}
	return nil
}
