package admin

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/text"
)

// Moving a tenant from one shard to another (see docs/sharding.md): drain the
// tenant (stop its consumers and HTTP handlers, or route it nowhere), move its rows
// with MoveTenant, switch the route (a Table entry), and resume. Without the move
// the new shard has none of the tenant's inbox keys, so a redelivery of a message
// the old shard recorded runs its handler again, and the old shard's pending
// effects are sent from there while the new shard knows nothing of them.

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
	// and discarded effects always. What is not copied is deleted all the same:
	// no row of the tenant stays on the old shard.
	EffectsRetention time.Duration
	// DryRun counts what would be moved and changes nothing.
	DryRun bool
}

// MoveResult is a move's plan (counted on the old shard) and what the move did.
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
	// InboxCopied and EffectsCopied are the rows the move inserted on the new
	// shard (rows already there are left as they are).
	InboxCopied   int64 `json:"inbox_copied"`
	EffectsCopied int64 `json:"effects_copied"`
	// InboxDeleted and EffectsDeleted are the rows the move deleted from the old
	// shard: each once it was on the new one, and the expired keys and the done
	// effects past the retention, which are not copied.
	InboxDeleted   int64 `json:"inbox_deleted"`
	EffectsDeleted int64 `json:"effects_deleted"`
	// HandedOver are the pending effects among EffectsDeleted: sent from the new
	// shard alone from now on.
	HandedOver int64 `json:"handed_over"`
}

// moveBatch is how many rows one copy statement carries.
const moveBatch = 500

// MoveTenant moves a drained tenant's rows from its old shard to its new one: its
// inbox keys (until they expire) and effects in every state (done ones within the
// retention) are copied, and every row of the tenant is deleted from the old
// shard, so that after the route is switched its redeliveries are recognised as
// duplicates, its pending effects are sent once, from the new shard, and its
// failed keys and dead effects are repaired once, from the new shard. It needs an
// Admin over a shard map of plain Postgres databases: on Citus it is refused
// (ErrCitusMovesTenants), since Citus moves tenants itself.
//
// The move goes batch by batch, and a crash anywhere leaves no effect live on
// two shards:
//
//  1. The tenant's pending effects are parked on the old shard (due far in the
//     future, in one transaction that also checks the tenant is drained): no
//     dispatcher claims them there.
//  2. Each batch of rows is inserted on the new shard (a row already there is kept
//     as it is), and then deleted from the old shard if it has not changed since
//     it was read. Between the two, the batch is on both shards: parked (pending
//     effects), or rows that no operator action touches, since an action refuses
//     a tenant's rows on a shard its route does not name (ErrOffRoute).
//  3. The parked effects get their due times back on the new shard, and its
//     dispatchers are woken up.
//  4. The tenant's expired keys and old done effects are deleted from the old
//     shard; a row of the tenant still there (written or changed during the move:
//     the tenant was not drained) fails the move with ErrNotDrained.
//
// Every step is idempotent, so a move that failed half-way is finished by running
// it again, and a second run finds nothing to move.
func (a *Admin) MoveTenant(ctx context.Context, mv MoveTenant) (*MoveResult, error) {
	if !text.Storable(mv.Tenant) {
		// Postgres text never holds it, so no shard has rows of it.
		return nil, errorf(ErrBadFilter, "tenant %q: not valid UTF-8 text without NUL bytes, so no shard has rows of it", clip(mv.Tenant))
	}
	if a.Shards() == nil {
		// One database: there is no shard to move to; on Citus, say what moves
		// tenants there.
		if err := a.refuseCitusMove(ctx, mv.Tenant, 0); err != nil {
			return nil, err
		}
	}
	if mv.From == "" {
		i, err := a.parts.Index(mv.Tenant)
		if err != nil {
			return nil, err
		}
		mv.From = a.parts.Name(i)
	}
	f, t := a.parts.IndexOf(mv.From), a.parts.IndexOf(mv.To)
	switch {
	case f < 0 || mv.From == "":
		return nil, errorf(ErrBadFilter, "move from %q: not a shard of the map (%v)", mv.From, a.Shards())
	case t < 0 || mv.To == "":
		return nil, errorf(ErrBadFilter, "move to %q: not a shard of the map (%v)", mv.To, a.Shards())
	}
	from, to := a.parts.Part(f), a.parts.Part(t)
	if from == to {
		return nil, errorf(ErrBadFilter, "tenant %q: from and to are the same shard %q", mv.Tenant, mv.From)
	}
	if err := a.refuseCitusMove(ctx, mv.Tenant, f, t); err != nil {
		return nil, err
	}
	retention := cmp.Or(mv.EffectsRetention, DefaultMoveRetention)
	if err := sameColumns(ctx, from, to); err != nil {
		return nil, err
	}
	out := &MoveResult{Tenant: mv.Tenant, From: mv.From, To: mv.To, DryRun: mv.DryRun}
	if err := from.movePlan(ctx, mv.Tenant, retention, out); err != nil {
		return nil, &shardError{Shard: from.name, Err: err}
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
	var m moved
	err := moveRows(ctx, from, to, mv.Tenant, "inbox", "consumer", "key", `i.expires_at > now()`, nil, &m)
	out.InboxCopied, out.InboxDeleted = m.copied, m.deleted
	if err != nil {
		return out, err
	}
	moveStep("inbox_moved")
	m = moved{}
	err = moveRows(ctx, from, to, mv.Tenant, "effects", "kind", "key",
		`(i.state <> 'done' OR i.done_at > now() - $4::interval)`, []any{retention}, &m)
	out.EffectsCopied, out.EffectsDeleted, out.HandedOver = m.copied, m.deleted, m.pending
	if err != nil {
		return out, err
	}
	moveStep("effects_moved")
	// Every parked effect is on the new shard now: give it its due time back
	// there (a copy that was already there is not parked). The new shard's
	// dispatchers are woken up (the copy's INSERT does not).
	if _, err := to.db.Exec(ctx, `WITH back AS (
			UPDATE `+to.table("effects")+` SET next_attempt_at = next_attempt_at - `+parked+`
			WHERE tenant = $1 AND state = 'pending' AND next_attempt_at > `+parkedAbove+`
			RETURNING 1)
		SELECT count(*), pg_notify('idem_effects', $2) FROM back`, mv.Tenant, to.cfg.Schema); err != nil {
		return out, &shardError{Shard: to.name, Err: to.wrap(err)}
	}
	moveStep("handed_back")
	// What was not copied (keys that expired, done effects past the retention) is
	// deleted too, and nothing of the tenant may be left.
	var left int64
	err = from.db.QueryRow(ctx, `WITH i AS (DELETE FROM `+from.table("inbox")+` WHERE tenant = $1 AND expires_at <= now() RETURNING 1),
			e AS (DELETE FROM `+from.table("effects")+` WHERE tenant = $1 AND state = 'done' AND done_at <= now() - $2::interval RETURNING 1)
		SELECT (SELECT count(*) FROM i), (SELECT count(*) FROM e),
			(SELECT count(*) FROM `+from.table("inbox")+` WHERE tenant = $1 AND expires_at > now())
			+ (SELECT count(*) FROM `+from.table("effects")+` WHERE tenant = $1 AND (state <> 'done' OR done_at > now() - $2::interval))`,
		mv.Tenant, retention).Scan(&m.copied, &m.deleted, &left)
	if err != nil {
		return out, &shardError{Shard: from.name, Err: from.wrap(err)}
	}
	out.InboxDeleted += m.copied
	out.EffectsDeleted += m.deleted
	if left > 0 {
		return out, errorf(ErrNotDrained, "tenant %q: %d of its row(s) on shard %q were written or changed during the move, so they stay there; drain the tenant and move it again", mv.Tenant, left, mv.From)
	}
	a.cfg.Logger.LogAttrs(ctx, slog.LevelWarn, "idem: tenant moved to its new shard; switch its route now",
		slog.String("tenant", mv.Tenant), slog.String("from", mv.From), slog.String("to", mv.To),
		slog.Int64("inbox_copied", out.InboxCopied), slog.Int64("effects_copied", out.EffectsCopied),
		slog.Int64("inbox_deleted", out.InboxDeleted), slog.Int64("effects_deleted", out.EffectsDeleted),
		slog.Int64("handed_over", out.HandedOver))
	return out, nil
}

// moveStep is called after each step of MoveTenant that has committed, with its
// name. It does nothing; the crash tests set it to kill the process there.
var moveStep = func(string) {}

// busyWhere: what keeps a tenant from being drained.
const (
	busyInbox   = `state = 'processing' AND lease_until > now()`
	busyEffects = `state = 'pending' AND in_flight AND next_attempt_at > now() AND next_attempt_at <= ` + parkedAbove
)

func (a *part) movePlan(ctx context.Context, tenant string, retention time.Duration, out *MoveResult) error {
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
func (a *part) park(ctx context.Context, tenant string) error {
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
		return &shardError{Shard: a.name, Err: a.wrap(err)}
	}
	return err
}

// moved counts what moveRows did: rows inserted on the new shard, rows deleted
// from the old one, and the pending effects among them.
type moved struct{ copied, deleted, pending int64 }

// moveRows moves the tenant's rows of table that match where from one shard to
// the other, moveBatch at a time in primary key order, as JSON records of the
// whole row (so every column a migration added goes too): each batch is inserted
// on the new shard (a row already there is left as it is) and then deleted from
// the old one, each row only if it is still the record that was read.
func moveRows(ctx context.Context, from, to *part, tenant, table, k1, k2, where string, extra []any, m *moved) error {
	src := pgx.Identifier{from.cfg.Schema, table}.Sanitize()
	dst := pgx.Identifier{to.cfg.Schema, table}.Sanitize()
	a1, a2 := "", ""
	for {
		rows, err := from.db.Query(ctx, `SELECT to_jsonb(i), i.`+k1+`, i.`+k2+` FROM `+src+` i
			WHERE i.tenant = $1 AND (i.`+k1+`, i.`+k2+`) > ($2, $3) AND `+where+`
			ORDER BY i.`+k1+`, i.`+k2+` LIMIT `+fmt.Sprint(moveBatch), append([]any{tenant, a1, a2}, extra...)...)
		if err != nil {
			return &shardError{Shard: from.name, Err: from.wrap(err)}
		}
		var batch []json.RawMessage
		var rec json.RawMessage
		_, err = pgx.ForEachRow(rows, []any{&rec, &a1, &a2}, func() error {
			batch = append(batch, slices.Clone(rec))
			return nil
		})
		if err != nil {
			return &shardError{Shard: from.name, Err: from.wrap(err)}
		}
		if len(batch) == 0 {
			return nil
		}
		b, _ := json.Marshal(batch)
		tag, err := to.db.Exec(ctx, `INSERT INTO `+dst+` SELECT * FROM jsonb_populate_recordset(NULL::`+dst+`, $1::jsonb)
			ON CONFLICT DO NOTHING`, string(b))
		if err != nil {
			return &shardError{Shard: to.name, Err: to.wrap(err)}
		}
		m.copied += tag.RowsAffected()
		moveStep(table + "_inserted")
		var n, pending int64
		err = from.db.QueryRow(ctx, `WITH d AS (
				DELETE FROM `+src+` i USING jsonb_array_elements($2::jsonb) r(rec)
				WHERE i.tenant = $1 AND i.`+k1+` = r.rec->>'`+k1+`' AND i.`+k2+` = r.rec->>'`+k2+`' AND to_jsonb(i) = r.rec
				RETURNING i.state)
			SELECT count(*), count(*) FILTER (WHERE state = 'pending') FROM d`, tenant, string(b)).Scan(&n, &pending)
		if err != nil {
			return &shardError{Shard: from.name, Err: from.wrap(err)}
		}
		m.deleted += n
		if table == "effects" {
			m.pending += pending
		}
		if len(batch) < moveBatch {
			return nil
		}
	}
}

// sameColumns refuses a move between shards whose inbox or effects tables differ.
func sameColumns(ctx context.Context, from, to *part) error {
	cols := func(s *part) (string, error) {
		var c string
		err := s.db.QueryRow(ctx, `SELECT coalesce(string_agg(table_name || '.' || column_name || ' ' || data_type, ', ' ORDER BY table_name, column_name), '')
			FROM information_schema.columns WHERE table_schema = $1 AND table_name IN ('inbox', 'effects')`, s.cfg.Schema).Scan(&c)
		if err != nil {
			return "", &shardError{Shard: s.name, Err: s.wrap(err)}
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

// refuseCitusMove returns ErrCitusMovesTenants when one of the parts at indexes
// is Citus (idem's tables distributed there): Citus places tenants on its workers
// itself, and a move of rows within or out of it would fight its placement.
func (a *Admin) refuseCitusMove(ctx context.Context, tenant string, indexes ...int) error {
	for _, i := range indexes {
		p := a.parts.Part(i)
		citus, err := p.onCitus(ctx)
		if err != nil {
			return a.partErr(i, err)
		}
		if !citus {
			continue
		}
		where := "the database"
		if name := a.parts.Name(i); name != "" {
			where = fmt.Sprintf("shard %q", name)
		}
		return errorf(ErrCitusMovesTenants, "move of tenant %q: %s is Citus (schema %s is distributed), which places tenants on its workers itself; nothing was changed. "+
			"Move the shard that holds the tenant with SELECT citus_move_shard_placement(get_shard_id_for_distribution_column('%s', '%s'), …) "+
			"(isolate_tenant_to_new_shard first to move it alone), or rebalance with SELECT citus_rebalance_start()",
			tenant, where, p.cfg.Schema, p.table("inbox"), strings.ReplaceAll(tenant, "'", "''"))
	}
	return nil
}
