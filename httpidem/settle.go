package httpidem

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/citusmode"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/txmark"
)

// settle ends q's transaction after run and records the answer: a success is
// stored with the key and committed with the handler's work; a final client
// error is recorded after the work rolls back; anything else rolls back and
// stores nothing (in lease mode the lease is given back), so a retry runs again.
// Whenever idem's transaction is rolled back, rollBack first finds out whether the
// handler ended it itself, which settles the key instead. A request without a key
// commits a success and stores nothing.
func (e *engine) settle(q *request) {
	switch {
	case q.recoverErr != nil:
		if e.rollBack(q) {
			return
		}
		e.releaseLease(q)
		e.log.Warn("idem: Recover failed on a stale key; a retry asks again", append(q.attrs(), "fence", q.fence, "err", q.recoverErr)...)
		q.fail(OutcomeError, CodeRecoveryFailed, "an earlier attempt of this request was interrupted and could not be settled yet; retry with the same key", e.cfg.RetryAfter)
	case q.mode == modeUnkeyed:
		e.settleUnkeyed(q)
	case q.fault == faultNone && e.success(q.resp.Status):
		e.commit(q)
	case e.rollBack(q):
		// The handler ended idem's transaction itself; the key is settled.
	case q.fault != faultNone:
		e.releaseLease(q)
		e.answerFault(q, q.fault)
	case e.final(q.resp.Status):
		e.storeFailure(q)
	default:
		e.releaseLease(q)
		e.notFinal(q, q.resp)
	}
}

// commit stores a success response in q's transaction and commits, in one round
// trip: in transactional mode on the claimed row, in lease mode on the lease row if
// the fence still matches.
func (e *engine) commit(q *request) {
	ctx := q.r.Context()
	tx, resp := q.tx, q.resp
	stored, err := e.toStored(q, resp)
	if err == nil && ctx.Err() == nil {
		// Never cancelled once sent: a client leaving mid-commit must not turn a
		// commit into an unknown.
		cctx, span := e.child(context.WithoutCancel(ctx), spanCommit)
		if q.mode == modeLease {
			err = e.store.CompleteLeaseResponseCommit(cctx, tx.conn, q.claim.ID, q.fence, e.cfg.Retention, stored)
		} else {
			err = e.store.saveCommit(cctx, tx.conn, q.stmts, q.claim.ID, q.row, stored)
		}
		err = tx.noteEnded(err)
		endSpan(span, err)
		switch {
		case err == nil:
			if e.afterCommit != nil {
				e.afterCommit(q.r)
			}
			outcome := OutcomeCommitted
			if q.recovered {
				outcome = OutcomeRecovered
			}
			q.respond(outcome, resp, false)
			return
		case errors.Is(err, txmark.ErrCommitUnknown):
			// In lease mode the release is fenced and needs state processing: if the
			// commit did happen it changes nothing, and if not the key is free at once.
			e.releaseLease(q)
			e.log.Warn("idem: COMMIT failed; whether the request took effect is unknown until a retry with the same key",
				append(q.attrs(), "err", err)...)
			q.fail(OutcomeError, CodeCommitUnknown, "the outcome is unknown; retry with the same key to learn it", e.cfg.RetryAfter)
			return
		}
	}
	// Nothing committed by idem. Did the handler commit the claim itself?
	if e.rollBack(q) {
		return
	}
	switch {
	case errors.Is(err, inbox.ErrLeaseLost):
		// A newer holder took the key over; our work did not commit, and its
		// answer is the key's answer.
		e.log.Warn("idem: lease lost before the commit (the handler outlived Lease.Duration); rolled back", q.attrs()...)
		e.inProgress(q)
	case errors.Is(err, txmark.ErrTxReplaced):
		e.releaseLease(q)
		e.answerFault(q, faultTxEnded)
	case err == nil:
		e.releaseLease(q)
		e.ended(q, ctx.Err())
	default:
		e.releaseLease(q)
		e.saveFailed(q, err)
	}
}

// settleUnkeyed commits the transaction of a request without a key, with nothing
// stored, if its handler answered a success.
func (e *engine) settleUnkeyed(q *request) {
	ctx := q.r.Context()
	switch {
	case q.fault != faultNone:
		e.answerFault(q, q.fault)
		return
	case !e.success(q.resp.Status):
		e.notFinal(q, q.resp)
		return
	case ctx.Err() != nil:
		e.ended(q, ctx.Err())
		return
	}
	err := q.tx.Commit(context.WithoutCancel(ctx))
	switch {
	case errors.Is(err, txmark.ErrTxReplaced):
		e.answerFault(q, faultTxEnded)
	case err != nil:
		e.log.Warn("idem: COMMIT failed for a request without a key; its outcome is unknown", "operation", q.claim.Consumer, "err", err)
		q.fail(OutcomeError, CodeCommitUnknown, "the outcome is unknown", e.cfg.RetryAfter)
	default:
		q.respond(OutcomeUnkeyed, q.resp, false)
	}
}

// toStored is what is stored of resp: the allow-listed headers and the body, or a
// reference to it.
func (e *engine) toStored(q *request, resp *Response) (*storedResponse, error) {
	stored := toStoredResponse(resp, e.storedNames)
	if e.cfg.BodyReference != nil && resp.Status < 400 {
		ctx := context.WithValue(q.r.Context(), txKey{}, ownedTx{q.tx})
		ref, err := e.cfg.BodyReference.Reference(ctx, q.r, resp)
		if err != nil {
			return nil, fmt.Errorf("body reference: %w", err)
		}
		if ref != "" {
			if err := inbox.ValidateKey(ref); err != nil {
				return nil, fmt.Errorf("body reference: %w", err)
			}
			stored.BodyRef = ref
		}
	}
	return stored, nil
}

// storeFailure records a final client error with its response, after the
// handler's work rolled back, on the request's connection: in lease mode on the
// lease row, fenced; in transactional mode in a transaction of its own, and if
// another request settled the key meanwhile, that outcome is the answer.
func (e *engine) storeFailure(q *request) {
	ctx := q.r.Context()
	resp := q.resp
	stored := toStoredResponse(resp, e.storedNames)
	code, msg := "http_"+strconv.Itoa(resp.Status), http.StatusText(resp.Status)
	conn, err := e.acquire(ctx, q)
	res := responseClaim{ClaimResult: inboxdb.ClaimResult{Claimed: true}}
	if err == nil {
		if q.mode == modeLease {
			err = e.store.FailLeaseResponse(ctx, conn.conn, q.claim.ID, q.fence, e.cfg.Retention, code, msg, stored)
		} else {
			res, err = e.recordFailure(ctx, conn, q.claim, code, msg, stored)
		}
	}
	switch {
	case errors.Is(err, inbox.ErrLeaseLost):
		e.inProgress(q)
	case err != nil:
		e.releaseLease(q)
		e.dbFailed(q, "record the final client error", err)
	case !res.Claimed:
		e.answerExisting(q, res)
	case q.recovered:
		q.respond(OutcomeRecovered, resp, false)
	default:
		q.respond(OutcomeFailed, resp, false)
	}
}

// lockTimeoutSQL bounds the wait for a concurrent request with the key. SET LOCAL
// takes no bind parameters; the value is an integer we format.
func lockTimeoutSQL(wait time.Duration) string {
	return "SET LOCAL lock_timeout = " + strconv.FormatInt(max(wait.Milliseconds(), 1), 10)
}

// recordFailure records c as failed with code, msg and stored, in a transaction of
// its own on conn (outside any transaction), waiting up to LockTimeout for a concurrent
// request with the key; if the key has a row, it returns that instead.
func (e *engine) recordFailure(ctx context.Context, conn *connTx, c inboxdb.Claim, code, msg string, stored *storedResponse) (res responseClaim, err error) {
	opts := pgx.TxOptions{IsoLevel: pgx.ReadCommitted}
	if e.onCitus(ctx, conn.conn) {
		opts.BeginQuery = citusmode.Begin(opts.IsoLevel)
	}
	err = pgx.BeginTxFunc(ctx, conn.conn, opts, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, lockTimeoutSQL(e.cfg.LockTimeout)); err != nil {
			return err
		}
		var err error
		res, err = e.store.FailResponseTx(ctx, tx, c, code, msg, stored)
		return err
	})
	return res, err
}

// releaseLease gives q's leased key back at once (lease_until = now(), fenced), so
// that a retry need not wait out the lease; outside lease mode it does nothing. It
// runs on the request's connection, outside any transaction, bounded by
// settleTimeout: if it fails, the lease runs out by itself.
func (e *engine) releaseLease(q *request) {
	if q.mode != modeLease {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(q.r.Context()), settleTimeout)
	defer cancel()
	conn, err := e.acquire(ctx, q)
	if err == nil {
		err = e.store.releaseLease(ctx, conn.conn, q.claim.ID, q.fence)
	}
	if err != nil {
		e.log.Warn("idem: the lease could not be given back; a retry waits until it runs out", append(q.attrs(), "fence", q.fence, "err", err)...)
	}
}

// rollBack rolls back what is open on q's transaction after the handler ran. If
// the handler ended idem's transaction itself (a raw COMMIT or ROLLBACK, with or
// without a BEGIN after it), or a statement failed in it (after which the mark
// cannot be asked), the database tells whether the request's work committed: in
// transactional mode the key's claim row, in lease mode the status of the
// transaction's ID. Work that committed settles the key with the stored
// handler_committed problem. A handler that ended the transaction without its
// work committing (a ROLLBACK) settles it with the stored handler_ended_transaction
// problem, recorded as failed in a fresh transaction: what it wrote after the
// ROLLBACK committed on its own, so it must not run again. Either way every retry
// gets a stable, coded answer and none runs the handler again. A transaction that
// merely failed on a statement, with nothing committed, settles nothing: a retry
// runs the request again. Everything runs on the request's one connection.
//
// It reports false when nothing of the request committed and nothing was settled.
// Otherwise it has recorded the answer: the stored problem; the key's answer if
// another request settled it meanwhile (after a ROLLBACK freed the key); 409 if
// the lease was lost, or a concurrent request still holds the key; 503
// commit_unknown if the database could not say whether the work committed; 500
// transaction_ended if the ended key could not be recorded.
func (e *engine) rollBack(q *request) bool {
	tx, fence := q.tx, q.fence
	end := tx.rollbackMarked(q.r.Context())
	if end == txOpen {
		return false // idem's transaction was still open: rolled back, nothing committed
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(q.r.Context()), settleTimeout)
	defer cancel()
	xid := tx.xid
	// The same connection, now outside any transaction (or a new one, if the
	// rollback closed it).
	conn, err := e.acquire(ctx, q)
	committed := true
	if err == nil && fence > 0 {
		// The lease row is not in the handler's transaction; its ID tells. Anything
		// but "aborted" (an error included) counts as committed: work that may have
		// committed is never run again.
		var status *string
		if err := conn.QueryRow(ctx, xidStatusSQL, xid).Scan(&status); err == nil && status != nil && *status == "aborted" {
			committed = false
		}
	}
	if err == nil && committed {
		stored := problemResponse(CodeHandlerCommitted, handlerCommittedDetail, 0)
		var ok bool
		ok, err = e.store.AnswerCommitted(ctx, conn.conn, q.claim, fence, CodeHandlerCommitted,
			"the handler committed the request's transaction itself (raw SQL); its answer could not be stored",
			&storedResponse{Status: stored.Status, Header: stored.Header, Body: stored.Body})
		switch {
		case err == nil && ok:
			e.log.Error("idem: the handler committed the request's transaction itself (raw COMMIT): its work committed without its answer, so the key is settled with a stored handler_committed problem, and a transaction it began after that was rolled back. Never end the transaction httpidem.Tx gives",
				q.attrs()...)
			q.respond(OutcomeError, stored, false)
			return true
		case err == nil && fence > 0:
			e.log.Error("idem: the handler committed the request's transaction itself (raw COMMIT), and its lease was lost meanwhile", q.attrs()...)
			e.inProgress(q)
			return true
		}
		// Transactional mode, and the claim did not commit: the handler rolled it
		// back, or a statement failed in idem's transaction.
	}
	if err != nil {
		e.log.Error("idem: the handler ended or broke the request's transaction, and whether its work committed could not be read; a retry with the key settles it",
			append(q.attrs(), "err", err)...)
		q.fail(OutcomeError, CodeCommitUnknown, "the outcome is unknown; retry with the same key to learn it", e.cfg.RetryAfter)
		return true
	}
	if end != txEnded {
		return false // a statement failed and nothing committed: the retry runs again
	}
	e.settleEnded(ctx, q, conn)
	return true
}

// settleEnded records q's key as failed with the stored handler_ended_transaction
// problem, after its handler ended idem's transaction without its work committing:
// in transactional mode in a fresh transaction on conn (if another request has
// claimed the key since the handler's ROLLBACK freed it, that request's outcome is
// the answer), in lease mode on the lease row, fenced. It records the answer.
func (e *engine) settleEnded(ctx context.Context, q *request, conn *connTx) {
	const msg = "the handler ended the request's transaction itself (raw ROLLBACK or COMMIT); what it wrote after that committed on its own"
	p := problemResponse(CodeHandlerEndedTransaction, handlerEndedDetail, 0)
	stored := &storedResponse{Status: p.Status, Header: p.Header, Body: p.Body}
	var (
		res responseClaim
		err error
	)
	if q.fence > 0 {
		err = e.store.FailLeaseResponse(ctx, conn.conn, q.claim.ID, q.fence, e.cfg.Retention, CodeHandlerEndedTransaction, msg, stored)
		res.Claimed = err == nil
	} else {
		res, err = e.recordFailure(ctx, conn, q.claim, CodeHandlerEndedTransaction, msg, stored)
	}
	var pgErr *pgconn.PgError
	switch {
	case errors.Is(err, inbox.ErrLeaseLost), errors.As(err, &pgErr) && pgErr.Code == pgerrcode.LockNotAvailable:
		// A newer holder, or a concurrent request with the key: its answer is the
		// key's.
		e.log.Error("idem: the handler ended the request's transaction itself (raw ROLLBACK or COMMIT), and another request holds its key now", q.attrs()...)
		e.inProgress(q)
	case err != nil:
		e.log.Error("idem: the handler ended the request's transaction itself (raw ROLLBACK or COMMIT), and its key could not be recorded: a retry runs it again. Never end the transaction httpidem.Tx gives",
			append(q.attrs(), "err", err)...)
		q.fail(OutcomeError, CodeTransactionEnded, "the handler ended the request's transaction, and its key could not be recorded; nothing was stored, and a retry runs the request again", 0)
	case !res.Claimed:
		e.log.Error("idem: the handler ended the request's transaction itself (raw ROLLBACK or COMMIT), and another request settled its key meanwhile", q.attrs()...)
		e.answerExisting(q, res)
	default:
		e.log.Error("idem: the handler ended the request's transaction itself (raw ROLLBACK or COMMIT): what it wrote after that committed on its own, so the key is recorded as failed with a stored handler_ended_transaction problem and never runs again. Never end the transaction httpidem.Tx gives",
			q.attrs()...)
		q.respond(OutcomeError, p, false)
	}
}
