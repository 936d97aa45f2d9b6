package httpidem

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"runtime/debug"
	"strconv"
	"time"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/txmark"
)

// serveLease is lease mode. The key commits first, as processing with a lease and a
// fence; the handler then runs in a transaction that settles the key (with the
// response) only if the fence still matches. A request that finds a fresh lease
// waits up to LockTimeout for it to settle, then answers 409. One that finds a lease that
// ran out takes it over (fence + 1) and asks Recover what to do, in the
// transaction the handler would run in.
//
// The lease commits on a pool connection that goes straight back, and the wait
// for a held lease holds none; from the transaction on, every statement runs on
// the request's one connection (acquire).
func (m *Middleware) serveLease(q *request) {
	ctx := q.r.Context()
	cctx, span := m.startClaim(q)
	start := time.Now()
	res, err := m.store.LeaseResponse(cctx, m.cfg.Pool, q.claim, m.cfg.Lease)
	if err == nil && !res.Claimed && !res.Mismatch && res.Existing.State == inboxdb.StateProcessing {
		res, err = m.waitForLease(q, start)
	}
	m.metrics.op(q.claim.Consumer).lockWait.Observe(time.Since(start).Seconds())
	endClaim(span, res.ClaimResult, err)
	if err != nil {
		m.dbFailed(q, "lease", err)
		return
	}
	m.noteExpired(q, res)
	if !res.Claimed {
		m.answerExisting(q, res)
		return
	}
	id, fence := q.claim.ID, res.Fence

	tx, err := m.begin(ctx, q, true)
	if err != nil {
		m.releaseLease(q, fence)
		m.dbFailed(q, "begin", err)
		return
	}
	onPanic := func() {
		if m.rollBack(q, tx, fence) == nil {
			m.releaseLease(q, fence)
		}
	}
	var resp *Response
	f, outcome := faultNone, OutcomeCommitted
	// A fence above 1 means an earlier attempt held this key and never settled it.
	if fence > 1 {
		decision := "rerun"
		if m.cfg.Recover != nil {
			var rerr error
			resp, f, rerr = m.askRecover(q, tx, fence, onPanic)
			switch {
			case rerr != nil:
				m.metrics.op(id.Consumer).stale["error"].Inc()
				if answer := m.rollBack(q, tx, fence); answer != nil {
					answer()
					return
				}
				m.releaseLease(q, fence)
				m.count(id.Consumer, OutcomeError)
				m.log.Warn("idem: Recover failed on a stale key; a retry asks again", append(q.attrs(), "fence", fence, "err", rerr)...)
				q.problem(CodeRecoveryFailed, "an earlier attempt of this request was interrupted and could not be settled yet; retry with the same key", m.cfg.RetryAfter)
				return
			case f != faultNone:
				decision = "error"
			case resp != nil:
				decision, outcome = "recovered", OutcomeRecovered
				m.log.Info("idem: Recover settled a stale key without running the handler", append(q.attrs(), "fence", fence, "status", resp.Status)...)
			}
		}
		m.metrics.op(id.Consumer).stale[decision].Inc()
		if decision == "rerun" {
			m.log.Info("idem: running a stale key again", append(q.attrs(), "fence", fence)...)
		}
	}
	if resp == nil && f == faultNone {
		resp, f = m.run(q, tx, onPanic)
	}
	if f != faultNone {
		if answer := m.rollBack(q, tx, fence); answer != nil {
			answer()
			return
		}
		m.releaseLease(q, fence)
		m.answerFault(q, f)
		return
	}
	m.settleLease(q, fence, tx, resp, outcome)
}

// askRecover asks Config.Recover about a stale key, with the request's transaction
// in its context as a handler has it. A panic rolls back (onPanic) and panics on.
// A response is judged as a handler's is: it cannot be used if the request's
// context ended, nor if it is a success and the transaction is no longer open and
// healthy; and a nil one (run the handler) cannot be either then, since the
// handler would run outside idem's transaction.
func (m *Middleware) askRecover(q *request, tx *connTx, fence int64, onPanic func()) (resp *Response, f fault, err error) {
	ctx := q.r.Context()
	hctx := m.handlerContext(ctx, q, tx)
	func() {
		defer func() {
			if v := recover(); v != nil {
				onPanic()
				m.count(q.claim.Consumer, OutcomePanic)
				m.log.Error("idem: Recover panicked; its work is rolled back and the lease given back",
					append(q.attrs(), "panic", fmt.Sprint(v), "stack", string(debug.Stack()))...)
				panic(v)
			}
		}()
		id := q.claim.ID
		resp, err = m.cfg.Recover(hctx, Stale{Request: q.r, Operation: id.Consumer, Tenant: id.Tenant, Key: id.Key, Fence: fence})
	}()
	switch {
	case err != nil:
		return nil, faultNone, err
	case ctx.Err() != nil:
		return nil, faultCanceled, nil
	case (resp == nil || m.success(resp.Status)) && tx.Conn().PgConn().TxStatus() != 'T':
		return nil, faultTxEnded, nil
	}
	return resp, faultNone, nil
}

// releaseLease gives a leased key back at once (lease_until = now(), fenced), so
// that a retry need not wait out the lease. It runs on the request's connection,
// outside any transaction, bounded by settleTimeout: if it fails, the lease runs
// out by itself.
func (m *Middleware) releaseLease(q *request, fence int64) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(q.r.Context()), settleTimeout)
	defer cancel()
	conn, err := m.acquire(ctx, q)
	if err == nil {
		err = m.store.ReleaseLease(ctx, conn.conn, q.claim.ID, fence)
	}
	if err != nil {
		m.log.Warn("idem: the lease could not be given back; a retry waits until it runs out", append(q.attrs(), "fence", fence, "err", err)...)
	}
}

// settleLease settles a leased key with resp: a success commits it in tx with the
// handler's (or Recover's) work, a final client error is recorded after tx rolls
// back, anything else gives the key back. Whenever tx is rolled back, rollBack
// first finds out whether the handler committed part of its work itself, or ended
// the transaction; then that settles the key.
func (m *Middleware) settleLease(q *request, fence int64, tx *connTx, resp *Response, outcome string) {
	ctx := q.r.Context()
	id := q.claim.ID
	switch {
	case m.success(resp.Status):
		stored, err := m.toStored(q, tx, resp)
		if err == nil && ctx.Err() == nil {
			cctx, span := m.child(context.WithoutCancel(ctx), spanCommit)
			err = tx.noteEnded(m.store.CompleteLeaseResponseCommit(cctx, tx.conn, id, fence, m.cfg.Retention, stored))
			endSpan(span, err)
			switch {
			case err == nil:
				m.committed(q, resp, nil, outcome)
				return
			case errors.Is(err, txmark.ErrCommitUnknown):
				// The release is fenced and needs state processing: if the commit did
				// happen it changes nothing, and if not the key is free at once.
				m.releaseLease(q, fence)
				m.committed(q, resp, err, outcome)
				return
			}
		}
		// Nothing committed by idem.
		if answer := m.rollBack(q, tx, fence); answer != nil {
			answer()
			return
		}
		switch {
		case errors.Is(err, inbox.ErrLeaseLost):
			// A newer holder took the key over; our work did not commit, and its
			// answer is the key's answer.
			m.log.Warn("idem: lease lost before the commit (the handler outlived Lease); rolled back", q.attrs()...)
			m.inProgress(q)
		case errors.Is(err, txmark.ErrTxReplaced):
			m.releaseLease(q, fence)
			m.answerFault(q, faultTxEnded)
		case err == nil:
			m.releaseLease(q, fence)
			m.ended(q, ctx.Err())
		default:
			m.releaseLease(q, fence)
			m.saveFailed(q, err)
		}
	case m.final(resp.Status):
		if answer := m.rollBack(q, tx, fence); answer != nil {
			answer()
			return
		}
		stored := toStoredResponse(resp, m.storedNames)
		conn, err := m.acquire(ctx, q)
		if err == nil {
			err = m.store.FailLeaseResponse(ctx, conn.conn, id, fence, m.cfg.Retention, "http_"+strconv.Itoa(resp.Status), http.StatusText(resp.Status), stored)
		}
		if errors.Is(err, inbox.ErrLeaseLost) {
			m.inProgress(q)
			return
		}
		if err != nil {
			m.releaseLease(q, fence)
			m.dbFailed(q, "record the final client error", err)
			return
		}
		if outcome == OutcomeCommitted {
			outcome = OutcomeFailed
		}
		m.count(id.Consumer, outcome)
		q.send(resp, false)
	default:
		if answer := m.rollBack(q, tx, fence); answer != nil {
			answer()
			return
		}
		m.releaseLease(q, fence)
		m.notFinal(q, resp)
	}
}

// waitForLease polls a key held by a fresh lease until it settles, its lease runs
// out (then this request takes it over), or LockTimeout has passed since start.
func (m *Middleware) waitForLease(q *request, start time.Time) (responseClaim, error) {
	ctx := q.r.Context()
	if m.onLeaseWait != nil {
		m.onLeaseWait(q.r)
	}
	pause := 10 * time.Millisecond
	for {
		left := m.cfg.LockTimeout - time.Since(start)
		if left <= 0 {
			return responseClaim{ClaimResult: inboxdb.ClaimResult{Existing: &inboxdb.Record{State: inboxdb.StateProcessing}}}, nil
		}
		select {
		case <-ctx.Done():
			return responseClaim{}, ctx.Err()
		case <-time.After(min(pause, left)):
		}
		pause = min(2*pause, 200*time.Millisecond)
		res, err := m.store.LeaseResponse(ctx, m.cfg.Pool, q.claim, m.cfg.Lease)
		if err != nil || res.Claimed || res.Mismatch || res.Existing.State != inboxdb.StateProcessing {
			return res, err
		}
	}
}
