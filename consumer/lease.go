package consumer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/attribute"

	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/tracing"
	"github.com/idemkit/idem/internal/txmark"
)

// handleLease is the lease mode. The claim commits first, as a processing row with a
// lease and a fence; the handler then runs in a transaction that completes the row
// only if the fence still matches. A delivery that finds a fresh lease nacks after
// BusyDelay; one that finds a lease that ran out takes it over (fence + 1), so a
// handler that crashed, or outlived its lease, is run again.
func (c *engine) handleLease(req *request, h message.HandlerFunc) outcome {
	ctx := req.ctx
	db, ok := c.cfg.Pool.(inboxdb.DBTX)
	if !ok {
		return outcome{kind: outTransient, err: errors.New("lease mode needs a Pool that can Exec and Query (a *pgxpool.Pool)")}
	}
	cctx, span := c.child(ctx, spanClaim)
	start := time.Now()
	res, err := c.store.Lease(cctx, db, req.claim, c.cfg.Lease)
	c.metrics.lockWait.WithLabelValues(req.claim.Consumer).Observe(time.Since(start).Seconds())
	if err == nil && span.IsRecording() {
		span.SetAttributes(tracing.Outcome.String(claimOutcome(res)), attribute.Int64("idem.lease.fence", res.Fence))
	}
	endSpan(span, err)
	if err != nil {
		return classify(err)
	}
	c.noteExpired(req, res)
	if !res.Claimed {
		return existingOutcome(res)
	}
	id, fence := req.claim.ID, res.Fence
	// release gives the key back at once, so the redelivery need not wait out the
	// lease. It is fenced and only touches a processing row, so it never undoes a
	// completion, not even one whose COMMIT is still in flight (it waits for that
	// row lock).
	release := func() { _ = c.store.ReleaseLease(context.WithoutCancel(ctx), db, id, fence) }

	tx, err := c.begin(ctx)
	if err != nil {
		release()
		return canceled(ctx, outcome{kind: outTransient, err: fmt.Errorf("begin: %w", err)})
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := tx.Exec(ctx, txmark.Mark); err != nil {
		release()
		return canceled(ctx, outcome{kind: outTransient, err: fmt.Errorf("begin: %w", err)})
	}
	defer func() {
		// A panicking handler gives its lease back like a failing one, then panics
		// on, as in Transactional mode, for a middleware.Recoverer outside to turn
		// into an error.
		if p := recover(); p != nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
			release()
			panic(p)
		}
	}()
	o := c.runHandler(req, tx, h)
	switch o.kind {
	case outCommitted:
		cctx, span := c.child(ctx, spanCommit)
		if err := c.store.CompleteLeaseTx(cctx, tx, id, fence, c.cfg.Retention); err != nil {
			// ErrLeaseLost: a newer holder owns the key; our work must not commit
			// (and the fenced release is a no-op). Any other error rolls back.
			endSpan(span, err)
			release()
			return canceled(ctx, outcome{kind: outTransient, err: err})
		}
		err := c.commit(ctx, tx)
		endSpan(span, err)
		if err != nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
			if errors.Is(err, ErrTxEnded) {
				return c.failLease(req, db, fence, err)
			}
			release()
			return outcome{kind: outTransient, err: err}
		}
		return o
	case outPermanent:
		_ = tx.Rollback(context.WithoutCancel(ctx))
		if err := c.store.FailLease(ctx, db, id, fence, c.cfg.Retention, failureCode(o.err), truncate(o.err.Error())); err != nil {
			return outcome{kind: outTransient, err: fmt.Errorf("record permanent failure (%v): %w", o.err, err)}
		}
		return outcome{kind: outRecorded, err: o.err}
	case outEnded:
		_ = tx.Rollback(context.WithoutCancel(ctx))
		return c.failLease(req, db, fence, o.err)
	default:
		_ = tx.Rollback(context.WithoutCancel(ctx))
		release()
		return canceled(ctx, o)
	}
}

// failLease settles a key whose handler ended its transaction itself, as
// recordEnded does in the other modes: statements after that committed on their
// own, and the lease row was not completed with the work, so running the handler
// again could commit them twice. The key is recorded as failed with ErrTxEnded's
// code, on the lease row (fenced), with the connection of the handler's transaction
// back in the pool: it is never run again and never silently dropped (OnFailure,
// the failed metric, and PoisonOnPermanent see it).
func (c *engine) failLease(req *request, db inboxdb.DBTX, fence int64, cause error) outcome {
	c.logEnded(req, cause)
	ctx, cancel := context.WithTimeout(context.WithoutCancel(req.ctx), c.cfg.CommitTimeout)
	defer cancel()
	err := c.store.FailLease(ctx, db, req.claim.ID, fence, c.cfg.Retention,
		ErrTxEnded.Code(), truncate(cause.Error()))
	if err != nil {
		// The lease stays; when it runs out the next delivery runs the handler again.
		return outcome{kind: outTransient, err: fmt.Errorf("record the ended transaction (%v): %w", cause, err)}
	}
	return outcome{kind: outRecorded, err: cause}
}
