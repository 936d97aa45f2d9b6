package admin

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/fanout"
)

// Requeue brings one dead effect, named by its whole identity, back to pending
// (effectsdb.RequeueDead): attempts start again from 0, it is due now, and
// dispatchers are notified. An effect that is not dead is ErrNotDead, one that does
// not exist ErrNotFound; either way nothing changed. Over a shard map it requeues
// the effect on the shard that has it dead, and is refused (ErrOffRoute) when that
// is not the shard the route names for its tenant.
func (a *Admin) Requeue(ctx context.Context, id EffectID) error {
	if err := a.offRoute(ctx, "requeue of effect "+id.String(), func(ctx context.Context, p *part) ([]string, error) {
		return p.tenantsOf(ctx, `SELECT tenant FROM `+p.table("effects")+` WHERE tenant = $1 AND kind = $2 AND key = $3 AND state = 'dead'`,
			id.Tenant, id.Kind, id.Key)
	}); err != nil {
		return err
	}
	_, errs := fanout.Collect(a.parts, func(_ int, p *part) (struct{}, error) { return struct{}{}, p.requeue(ctx, id) })
	var notDead, notFound error
	for i, err := range errs {
		switch {
		case err == nil:
			return nil
		case errors.Is(err, ErrNotFound):
			notFound = cmp.Or(notFound, err)
			errs[i] = nil
		case errors.Is(err, ErrNotDead):
			notDead = cmp.Or(notDead, err)
			errs[i] = nil
		}
	}
	if err := a.join(errs); err != nil {
		return err
	}
	return cmp.Or(notDead, notFound)
}

func (a *part) requeue(ctx context.Context, id EffectID) error {
	n, err := effectsdb.RequeueDead(ctx, a.db, a.cfg.Schema, effectsdb.RequeueFilter{
		Tenant: id.Tenant, TenantExact: true, Kind: id.Kind, Key: id.Key,
	})
	if err != nil {
		return a.wrap(err)
	}
	if n > 0 {
		return nil
	}
	e, err := a.inspectEffect(ctx, id)
	if err != nil {
		return err
	}
	return errorf(ErrNotDead, "effect %s is %s, not dead: nothing to requeue", id, e.State)
}

// RequeueDead brings every dead effect that f picks back to pending and returns how
// many; see effectsdb.RequeueDead for the filter's rules. Over a shard map it is
// refused (ErrOffRoute) when some of those effects are on a shard their tenant's
// route does not name.
func (a *Admin) RequeueDead(ctx context.Context, f effectsdb.RequeueFilter) (int64, error) {
	if err := a.offRoute(ctx, "requeue", func(ctx context.Context, p *part) ([]string, error) {
		return p.tenantsOf(ctx, `SELECT DISTINCT tenant FROM `+p.table("effects")+`
			WHERE state = 'dead' AND ($1 = '' OR kind = $1) AND ($2 = '' OR key = $2) AND (($3 = '' AND NOT $4) OR tenant = $3)`,
			f.Kind, f.Key, f.Tenant, f.TenantExact)
	}); err != nil {
		return 0, err
	}
	res, errs := fanout.Collect(a.parts, func(_ int, p *part) (int64, error) {
		n, err := effectsdb.RequeueDead(ctx, p.db, p.cfg.Schema, f)
		return n, p.wrap(err)
	})
	var n int64
	for _, r := range res {
		n += r
	}
	return n, a.join(errs)
}

// Audit says who forgets a key and why, for the log line.
type Audit struct {
	// Who asked: a user name, a ticket's author (empty: "unknown").
	Who string
	// Why: a reason, a ticket reference.
	Why string
}

// Forget deletes one inbox key and returns the row it deleted.
//
// It is dangerous: the next delivery of that key, or a retry of that HTTP request,
// runs its handler again, so the business work may commit a second time. Use it for
// a key recorded as failed whose cause is now fixed, or one whose command must run
// again on purpose. Effects the first run made stay as they are and keep their keys,
// so a re-run that enqueues the same effects enqueues nothing new.
//
// A key that a delivery holds under a running lease (lease mode) is refused with
// ErrLeaseHeld; a missing one is ErrNotFound. Every forget is logged at warn level
// with the key, its state and fingerprint, who and why. Over a shard map it forgets
// the key on the shard that has it, and is refused (ErrOffRoute) when that is not
// the shard the route names for its tenant.
func (a *Admin) Forget(ctx context.Context, id inbox.ID, audit Audit) (*InboxKey, error) {
	if err := id.Validate(); err != nil {
		return nil, err
	}
	if err := a.offRoute(ctx, "forget of inbox key "+formatID(id), func(ctx context.Context, p *part) ([]string, error) {
		return p.tenantsOf(ctx, `SELECT tenant FROM `+p.table("inbox")+` WHERE consumer = $1 AND tenant = $2 AND key = $3`,
			id.Consumer, id.Tenant, id.Key)
	}); err != nil {
		return nil, err
	}
	res, errs := fanout.Collect(a.parts, func(_ int, p *part) (*InboxKey, error) { return p.forget(ctx, id, audit) })
	var held, notFound error
	var out *InboxKey
	for i, err := range errs {
		switch {
		case err == nil:
			if out == nil {
				out = res[i]
				out.Shard = a.parts.Name(i)
			}
		case errors.Is(err, ErrNotFound):
			notFound = cmp.Or(notFound, err)
			errs[i] = nil
		case errors.Is(err, ErrLeaseHeld):
			held = cmp.Or(held, a.partErr(i, err))
			errs[i] = nil
		}
	}
	if err := cmp.Or(held, a.join(errs)); err != nil {
		return out, err
	}
	if out == nil {
		return nil, notFound
	}
	return out, nil
}

func (a *part) forget(ctx context.Context, id inbox.ID, audit Audit) (*InboxKey, error) {
	var k *InboxKey
	k, err := scanInboxKey(a.db.QueryRow(ctx, a.q.forget, id.Consumer, id.Tenant, id.Key))
	err = a.wrap(err)
	if errors.Is(err, pgx.ErrNoRows) {
		var state string
		var lease *time.Time
		err := a.db.QueryRow(ctx, a.q.inboxState, id.Consumer, id.Tenant, id.Key).Scan(&state, &lease)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			return nil, errorf(ErrNotFound, "no inbox key %s", formatID(id))
		case err != nil:
			return nil, a.wrap(err)
		}
		until := ""
		if lease != nil {
			until = " until " + lease.UTC().Format(time.RFC3339)
		}
		return nil, errorf(ErrLeaseHeld, "inbox key %s is %s under a delivery's lease%s: nothing was deleted; try again after the lease", formatID(id), state, until)
	}
	if err != nil {
		return nil, err
	}
	a.cfg.Logger.LogAttrs(ctx, slog.LevelWarn, "idem: inbox key forgotten; its next delivery runs the handler again",
		slog.String("schema", a.cfg.Schema),
		slog.String("consumer", k.Consumer), slog.String("tenant", k.Tenant), slog.String("key", k.Key),
		slog.String("state", k.State), slog.String("fingerprint", k.Fingerprint),
		slog.Time("received_at", k.ReceivedAt),
		slog.String("who", cmp.Or(audit.Who, "unknown")), slog.String("why", audit.Why))
	return k, nil
}

func formatID(id inbox.ID) string {
	if id.Tenant == "" {
		return fmt.Sprintf("consumer %q key %q", id.Consumer, id.Key)
	}
	return fmt.Sprintf("consumer %q tenant %q key %q", id.Consumer, id.Tenant, id.Key)
}
