package httpidem

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"time"

	"github.com/idemkit/idem/inbox"
)

// serveLease is lease mode. The key commits first, as processing with a lease and a
// fence; the handler then runs in a transaction that settles the key (with the
// response) only if the fence still matches. A request that finds a fresh lease
// waits up to Wait for it to settle, then answers 409. One that finds a lease that
// ran out takes it over (fence + 1) and asks Recover what to do.
func (m *Middleware) serveLease(q *request) {
	ctx := q.r.Context()
	cctx, span := m.startClaim(q)
	start := time.Now()
	res, err := m.store.LeaseResponse(cctx, m.cfg.Pool, q.claim, m.cfg.LeaseDuration)
	if err == nil && !res.Claimed && !res.Mismatch && res.Existing.State == inbox.StateProcessing {
		res, err = m.waitForLease(q, start)
	}
	m.metrics.lockWait.WithLabelValues(q.claim.Consumer).Observe(time.Since(start).Seconds())
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
	released := false
	release := func() {
		if !released {
			released = true
			// Give the key back at once, so that a retry need not wait out the lease.
			_ = m.store.ReleaseLease(context.WithoutCancel(ctx), m.cfg.Pool, id, fence)
		}
	}

	// A fence above 1 means an earlier attempt held this key and never settled it.
	if fence > 1 {
		if m.cfg.Recover == nil {
			m.metrics.stale.WithLabelValues(id.Consumer, "rerun").Inc()
		} else {
			resp, err := m.cfg.Recover(ctx, Stale{Request: q.r, Operation: id.Consumer, Tenant: id.Tenant, Key: id.Key, Fence: fence})
			switch {
			case err != nil:
				m.metrics.stale.WithLabelValues(id.Consumer, "error").Inc()
				release()
				m.count(id.Consumer, OutcomeError)
				m.log.Warn("idem: Recover failed on a stale key; a retry asks again", append(q.attrs(), "fence", fence, "err", err)...)
				writeProblem(q.w, CodeRecoveryFailed, "an earlier attempt of this request was interrupted and could not be settled yet; retry with the same key", m.cfg.RetryAfter)
				return
			case resp != nil:
				m.metrics.stale.WithLabelValues(id.Consumer, "recovered").Inc()
				m.log.Info("idem: Recover settled a stale key without running the handler", append(q.attrs(), "fence", fence, "status", resp.Status)...)
				m.settleLease(q, fence, nil, resp, release, OutcomeRecovered)
				return
			default:
				m.metrics.stale.WithLabelValues(id.Consumer, "rerun").Inc()
			}
		}
		m.log.Info("idem: running a stale key again", append(q.attrs(), "fence", fence)...)
	}

	tx, err := m.begin(ctx, true)
	if err != nil {
		release()
		m.dbFailed(q, "begin", err)
		return
	}
	defer tx.release(ctx)
	resp, f := m.run(q, tx, func() {
		if m.rollBack(q, tx, fence) == nil {
			release()
		}
	})
	if f != faultNone {
		if answer := m.rollBack(q, tx, fence); answer != nil {
			answer()
			return
		}
		release()
		m.answerFault(q, f)
		return
	}
	m.settleLease(q, fence, tx, resp, release, OutcomeCommitted)
}

// settleLease settles a leased key with resp: a success commits it in tx (a new
// transaction when tx is nil) with the handler's work, a final client error is
// recorded after tx rolls back, anything else gives the key back. Whenever tx is
// rolled back, rollBack first finds out whether the handler committed part of its
// work itself; then that settles the key.
func (m *Middleware) settleLease(q *request, fence int64, tx *connTx, resp *Response, release func(), outcome string) {
	ctx := q.r.Context()
	id := q.claim.ID
	// rolledBack rolls tx back; it reports true when that answered the request.
	rolledBack := func() bool {
		if tx == nil {
			return false
		}
		if answer := m.rollBack(q, tx, fence); answer != nil {
			answer()
			return true
		}
		return false
	}
	switch {
	case m.success(resp.Status):
		if tx == nil {
			var err error
			if tx, err = m.begin(ctx, true); err != nil {
				release()
				m.dbFailed(q, "begin", err)
				return
			}
			defer tx.release(ctx)
		}
		stored, err := m.toStored(q, tx, resp)
		if err == nil && ctx.Err() == nil {
			cctx, span := m.tracer.Start(context.WithoutCancel(ctx), spanCommit)
			err = m.store.CompleteLeaseResponseCommit(cctx, tx.conn, id, fence, m.cfg.Retention, stored)
			endSpan(span, err)
			switch {
			case err == nil:
				m.committed(q, resp, nil, outcome)
				return
			case errors.Is(err, inbox.ErrCommitUnknown):
				// The release is fenced and needs state processing: if the commit did
				// happen it changes nothing, and if not the key is free at once.
				tx.release(ctx)
				release()
				m.committed(q, resp, err, outcome)
				return
			}
		}
		// Nothing committed by idem.
		if rolledBack() {
			return
		}
		switch {
		case errors.Is(err, inbox.ErrLeaseLost):
			// A newer holder took the key over; our work did not commit, and its
			// answer is the key's answer.
			m.log.Warn("idem: lease lost before the commit (the handler outlived LeaseDuration); rolled back", q.attrs()...)
			m.inProgress(q)
		case errors.Is(err, inbox.ErrTxReplaced):
			release()
			m.answerFault(q, faultTxEnded)
		case err == nil:
			release()
			m.ended(q, ctx.Err())
		default:
			release()
			m.saveFailed(q, err)
		}
	case m.final(resp.Status):
		if rolledBack() {
			return
		}
		stored := &inbox.Response{Status: resp.Status, Header: storedHeader(resp.Header, m.cfg.StoredHeaders), Body: resp.Body}
		err := m.store.FailLeaseResponse(ctx, m.cfg.Pool, id, fence, m.cfg.Retention, "http_"+strconv.Itoa(resp.Status), http.StatusText(resp.Status), stored)
		if errors.Is(err, inbox.ErrLeaseLost) {
			m.inProgress(q)
			return
		}
		if err != nil {
			release()
			m.dbFailed(q, "record the final client error", err)
			return
		}
		if outcome == OutcomeCommitted {
			outcome = OutcomeFailed
		}
		m.count(id.Consumer, outcome)
		writeResponse(q.w, resp, false)
	default:
		if rolledBack() {
			return
		}
		release()
		m.notFinal(q, resp)
	}
}

// waitForLease polls a key held by a fresh lease until it settles, its lease runs
// out (then this request takes it over), or Wait has passed since start.
func (m *Middleware) waitForLease(q *request, start time.Time) (inbox.ResponseClaim, error) {
	ctx := q.r.Context()
	if m.onLeaseWait != nil {
		m.onLeaseWait(q.r)
	}
	pause := 10 * time.Millisecond
	for {
		left := m.cfg.Wait - time.Since(start)
		if left <= 0 {
			return inbox.ResponseClaim{ClaimResult: inbox.ClaimResult{Existing: &inbox.Record{State: inbox.StateProcessing}}}, nil
		}
		select {
		case <-ctx.Done():
			return inbox.ResponseClaim{}, ctx.Err()
		case <-time.After(min(pause, left)):
		}
		pause = min(2*pause, 200*time.Millisecond)
		res, err := m.store.LeaseResponse(ctx, m.cfg.Pool, q.claim, m.cfg.LeaseDuration)
		if err != nil || res.Claimed || res.Mismatch || res.Existing.State != inbox.StateProcessing {
			return res, err
		}
	}
}
