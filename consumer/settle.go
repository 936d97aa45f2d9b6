package consumer

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/text"
)

// outcomeKind is how a delivery ended in the inbox; finish answers it.
type outcomeKind int

const (
	outCommitted outcomeKind = iota // handler work is in the transaction; commit it
	outDuplicate                    // key completed before: ack
	outReplayed                     // key failed before: ack, replay to hooks
	outMismatch                     // same key, other payload
	outTransient                    // nack
	outBusy                         // key busy: nack after BusyDelay
	outPermanent                    // handler failed permanently: record it
	outRecorded                     // the permanent failure is recorded
	outRejected                     // invalid message that cannot be recorded
	// outEnded: the handler ended idem's transaction (ErrTxEnded). Once the
	// delivery's connection is back in the pool, recordEnded records the key as
	// failed in a fresh transaction; finish never sees this kind.
	outEnded
)

// outcome is a delivery's settled result, for finish to answer.
type outcome struct {
	kind outcomeKind
	err  error
	rec  *inboxdb.Record
	// claimFailed: err came from the claim's round trip, before the handler ran.
	claimFailed bool
}

// existingOutcome is the outcome of a claim that found the key's row.
func existingOutcome(res inboxdb.ClaimResult) outcome {
	rec := res.Existing
	switch {
	case res.Mismatch:
		return outcome{kind: outMismatch, rec: rec, err: fmt.Errorf("%w: consumer %q key %q", ErrFingerprintMismatch, rec.Consumer, rec.Key)}
	case rec.State == inboxdb.StateCompleted:
		return outcome{kind: outDuplicate, rec: rec}
	case rec.State == inboxdb.StateFailed:
		return outcome{kind: outReplayed, rec: rec}
	default: // a fresh lease held by another delivery
		return outcome{kind: outBusy, rec: rec, err: inbox.ErrLeaseHeld}
	}
}

// recordFailure records a permanent failure in a transaction of its own.
func (c *engine) recordFailure(req *request, cause error) outcome {
	return c.recordFailureCtx(req.ctx, req, cause)
}

// recordFailureCtx is recordFailure under ctx.
func (c *engine) recordFailureCtx(ctx context.Context, req *request, cause error) outcome {
	if !req.recordable && req.invalid != nil {
		return outcome{kind: outRejected, err: cause}
	}
	var res inboxdb.ClaimResult
	err := pgx.BeginTxFunc(ctx, c.cfg.Pool, c.txOptions(ctx, ""), func(tx pgx.Tx) error {
		if err := c.setLockTimeout(ctx, tx); err != nil {
			return err
		}
		var err error
		res, err = c.store.FailTx(ctx, tx, req.claim, failureCode(cause), truncate(cause.Error()))
		return err
	})
	if err != nil {
		return notRecorded(cause, err)
	}
	c.noteExpired(req, res)
	if !res.Claimed {
		return existingOutcome(res)
	}
	return outcome{kind: outRecorded, err: cause}
}

// recordEnded settles the key of a handler that ended idem's transaction (cause is
// ErrTxEnded): statements it ran after that committed on their own, so running it
// again could write them twice. The key is recorded as failed with ErrTxEnded's
// code in a fresh transaction. Call it only once the delivery holds no connection:
// the recording takes one from the pool. It runs under a context the message's
// cancellation cannot cut, bounded by CommitTimeout: a recording cut short would let
// a redelivery run the handler again. If the key's row is there already (the
// handler's own COMMIT committed the claim), the key is settled as that row says,
// and this delivery is still answered as the failure it is.
func (c *engine) recordEnded(req *request, cause error) outcome {
	c.logEnded(req, cause)
	ctx, cancel := context.WithTimeout(context.WithoutCancel(req.ctx), c.cfg.CommitTimeout)
	defer cancel()
	o := c.recordFailureCtx(ctx, req, cause)
	switch o.kind {
	case outDuplicate, outReplayed:
		return outcome{kind: outRecorded, err: cause}
	}
	return o
}

// logEnded says, loudly, that req's handler ended idem's transaction.
func (c *engine) logEnded(req *request, cause error) {
	c.log.Error("idem: the handler ended idem's transaction itself (raw COMMIT or ROLLBACK); statements after that committed on their own, so the key is recorded as failed and never run again. Return an error to roll back instead",
		append(req.attrs(), "err", cause)...)
}

// notRecorded is the outcome when recording a permanent failure failed: nothing is
// recorded, so the message is nacked and the redelivery fails the same way again.
func notRecorded(cause, err error) outcome {
	o := classify(err)
	if o.kind == outPermanent {
		o.kind = outTransient
	}
	o.err = fmt.Errorf("record permanent failure (%v): %w", cause, o.err)
	return o
}

func failureCode(err error) string {
	if code := errcode.Code(err); code != "" {
		return code
	}
	return "permanent"
}

// truncate makes an error's text the inbox row's stored error: valid text for
// Postgres (a NUL byte or invalid UTF-8 in a handler's error would make the insert
// fail, and the permanent failure would never be recorded) and at most MaxErrorLen
// bytes.
func truncate(s string) string { return text.Sanitize(s, MaxErrorLen) }

// classify turns an error from Postgres or a handler into a transient outcome.
func classify(err error) outcome {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == pgerrcode.LockNotAvailable {
		return outcome{kind: outBusy, err: fmt.Errorf("%w: %v", ErrBusy, err)}
	}
	if IsPermanent(err) {
		return outcome{kind: outPermanent, err: err}
	}
	return outcome{kind: outTransient, err: err}
}

// finish turns an outcome into the middleware's answer (nil acks, an error nacks or
// poisons, with its code left on the message: MetadataErrorCode), with metrics,
// logs and hooks.
func (c *engine) finish(req *request, o outcome) (err error) {
	defer func() { markErrorCode(req.msg, err) }()
	endMessage(req, o)
	name := req.claim.Consumer
	switch o.kind {
	case outCommitted:
		c.metrics.processed.WithLabelValues(name).Inc()
		return nil
	case outDuplicate:
		c.metrics.duplicates.WithLabelValues(name).Inc()
		if o.rec.CompletedAt != nil {
			c.metrics.duplicateAge.WithLabelValues(name).Observe(o.rec.Now.Sub(*o.rec.CompletedAt).Seconds())
		}
		c.log.Debug("idem: duplicate acked", req.attrs()...)
		return nil
	case outReplayed:
		c.metrics.failed.WithLabelValues(name, o.rec.ErrorCode, "true").Inc()
		c.log.Info("idem: redelivery of a failed key acked", append(req.attrs(), "code", o.rec.ErrorCode)...)
		c.hook(req, Failure{Code: o.rec.ErrorCode, Error: o.rec.Error, Replayed: true})
		return nil
	case outMismatch:
		c.metrics.mismatch.WithLabelValues(name).Inc()
		c.log.Error("idem: key reused with a different payload", req.attrs()...)
		return o.err
	case outBusy:
		c.metrics.transientNack.WithLabelValues(name, "busy").Inc()
		c.log.Info("idem: key busy, nacking", append(req.attrs(), "err", o.err)...)
		select {
		case <-time.After(c.cfg.BusyDelay):
		case <-req.ctx.Done():
		}
		if !errors.Is(o.err, ErrBusy) {
			o.err = fmt.Errorf("%w: %v", ErrBusy, o.err)
		}
		return o.err
	case outTransient, outEnded: // outEnded never comes here (recordEnded settles it)
		if errcode.Code(o.err) == "" && connectionLost(o.err) {
			o.err = fmt.Errorf("%w: %w", ErrDatabaseUnavailable, o.err)
		}
		code := cmp.Or(errcode.Code(o.err), "transient")
		c.metrics.transientNack.WithLabelValues(name, code).Inc()
		if errors.Is(o.err, ErrMessageNotInBatch) {
			c.log.Error("idem: the batch handler named a message that is not in its batch; nacking", append(req.attrs(), "err", o.err)...)
		} else {
			c.log.Info("idem: transient failure, nacking", append(req.attrs(), "err", o.err)...)
		}
		return o.err
	case outRejected:
		code := failureCode(o.err)
		c.metrics.failed.WithLabelValues(name, code, "false").Inc()
		c.log.Error("idem: message rejected; it has no valid key (or, over a shard map, no tenant), so the failure cannot be recorded and the message is returned as an error: "+
			"a middleware.PoisonQueue outside idem's middleware poisons it, else it is nacked and redelivered forever (on Kafka it holds its partition); err says what to configure",
			append(req.attrs(), "code", code, "err", o.err)...)
		c.hook(req, Failure{Code: code, Error: o.err.Error()})
		return o.err
	case outRecorded, outPermanent:
		code := failureCode(o.err)
		c.metrics.failed.WithLabelValues(name, code, "false").Inc()
		c.log.Warn("idem: permanent failure recorded", append(req.attrs(), "code", code, "err", o.err)...)
		c.hook(req, Failure{Code: code, Error: o.err.Error()})
		if c.cfg.PoisonOnPermanent {
			return &FailedError{Consumer: name, Tenant: req.claim.Tenant, Key: req.claim.Key, Err: o.err}
		}
		return nil
	}
	return fmt.Errorf("idem: unknown outcome %d", o.kind)
}

func (c *engine) hook(req *request, f Failure) {
	if c.cfg.OnFailure == nil {
		return
	}
	f.Consumer, f.Tenant, f.Key = req.claim.Consumer, req.claim.Tenant, req.claim.Key
	c.cfg.OnFailure(req.ctx, f)
}
