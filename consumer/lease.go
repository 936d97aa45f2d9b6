package consumer

import (
	"context"
	"errors"
	"fmt"

	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/inbox"
)

// handleLease is the lease mode. The claim commits first, as a processing row with a
// lease and a fence; the handler then runs in a transaction that completes the row
// only if the fence still matches. A delivery that finds a fresh lease nacks after
// BusyDelay; one that finds a lease that ran out takes it over (fence + 1), so a
// handler that crashed, or outlived its lease, is run again.
func (c *Consumer) handleLease(req *request, h message.HandlerFunc) error {
	ctx := req.ctx
	db, ok := c.cfg.Pool.(inbox.DBTX)
	if !ok {
		return c.finish(req, outcome{kind: outTransient, err: errors.New("lease mode needs a Pool that can Exec and Query (a *pgxpool.Pool)")})
	}
	start := time.Now()
	res, err := c.store.Lease(ctx, db, req.claim, c.cfg.LeaseDuration)
	c.metrics.lockWait.WithLabelValues(req.claim.Consumer).Observe(time.Since(start).Seconds())
	if err != nil {
		return c.finish(req, classify(err))
	}
	if !res.Claimed {
		return c.finish(req, existingOutcome(res))
	}
	id, fence := req.claim.ID, res.Fence

	tx, err := c.cfg.Pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: c.cfg.IsoLevel})
	if err != nil {
		_ = c.store.ReleaseLease(context.WithoutCancel(ctx), db, id, fence)
		return c.finish(req, outcome{kind: outTransient, err: fmt.Errorf("begin: %w", err)})
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	o := c.runHandler(req, tx, h)
	switch o.kind {
	case outCommitted:
		if err := c.store.CompleteLeaseTx(ctx, tx, id, fence, c.cfg.Retention); err != nil {
			// ErrLeaseLost: a newer holder owns the key; our work must not commit.
			return c.finish(req, outcome{kind: outTransient, err: err})
		}
		if err := tx.Commit(ctx); err != nil {
			return c.finish(req, outcome{kind: outTransient, err: fmt.Errorf("%w: %v", ErrCommitUnknown, err)})
		}
		return c.finish(req, o)
	case outPermanent:
		_ = tx.Rollback(ctx)
		if err := c.store.FailLease(ctx, db, id, fence, c.cfg.Retention, failureCode(o.err), truncate(o.err.Error())); err != nil {
			return c.finish(req, outcome{kind: outTransient, err: fmt.Errorf("record permanent failure (%v): %w", o.err, err)})
		}
		return c.finish(req, outcome{kind: outRecorded, err: o.err})
	default:
		_ = tx.Rollback(ctx)
		// Give the key back at once, so the redelivery need not wait out the lease.
		_ = c.store.ReleaseLease(context.WithoutCancel(ctx), db, id, fence)
		return c.finish(req, o)
	}
}
