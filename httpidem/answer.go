package httpidem

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/inboxdb"
)

// mode is how a request runs: read chooses it, and claim, run and settle follow it.
type mode int

const (
	modeUnkeyed mode = iota // no key, on a route where it is optional: a transaction, nothing stored
	modeTx                  // transactional: claim, handler and stored response in one transaction
	modeLease               // lease mode (Route.Lease): the key commits first, with a lease and a fence
)

// request is one request on its way through serve.
type request struct {
	w    http.ResponseWriter
	r    *http.Request
	next http.Handler
	// e is the part that runs the request (read picks it).
	e     *engine
	mode  mode
	body  []byte
	claim inboxdb.Claim

	// What claim found: the claimed row (transactional mode), the lease's fence
	// (lease mode), and the transaction the handler runs in.
	row   rowRef
	fence int64
	tx    *connTx
	// stmts are the prepared statements on the connection, when the store uses
	// them (transactional mode).
	stmts described

	// What run found: the response (the handler's or Recover's), the fault that
	// keeps it from being used, and Recover's decision and error.
	resp       *Response
	fault      fault
	recovered  bool
	recoverErr error

	// owned is the transaction the handler gets (Tx), rec holds its answer, and
	// bodyReader gives it the body again.
	owned      ownedTx
	rec        recorder
	bodyReader bodyReader
	// conn is the one pool connection the request holds, or nil. Every statement
	// of the request runs on it (acquire), and the answer is written after it went
	// back to the pool (answer): a request never holds two connections, and never
	// holds one while a slow client reads its answer.
	conn *connTx

	// The answer: out is written if answered (not: the client went away; a copy,
	// so that a replay's Response need not go to the heap), replayed marks a
	// stored one, problem idem's own; outcome is counted with it ("": nothing
	// counted).
	out      Response
	answered bool
	replayed bool
	problem  bool
	outcome  string
}

// respond records resp as the answer (nil: none), counted as outcome.
func (q *request) respond(outcome string, resp *Response, replayed bool) {
	q.outcome, q.answered, q.replayed, q.problem = outcome, resp != nil, replayed, false
	if resp != nil {
		q.out = *resp
	}
}

// fail records idem's problem for code as the answer, counted as outcome.
func (q *request) fail(outcome, code, detail string, retryAfter time.Duration) {
	q.respond(outcome, problemResponse(code, detail, retryAfter), false)
	q.problem = true
}

// answer counts the request's outcome, gives its connection back and writes its
// answer, if it has one.
func (q *request) answer() {
	if q.outcome != "" {
		q.e.metrics.op(q.claim.Consumer).requests[q.outcome].Inc()
	}
	q.release()
	if !q.answered {
		return
	}
	if q.problem {
		q.w.Header().Del(ReplayedHeader)
	}
	writeResponse(q.w, &q.out, q.replayed)
}

// acquire returns q's connection, open and outside any transaction: the one q
// holds if it is, otherwise a new one from the pool, acquired only after the old
// one went back to it.
func (e *engine) acquire(ctx context.Context, q *request) (*connTx, error) {
	if c := q.conn; c != nil {
		if !c.conn.IsClosed() && !c.inTx() {
			return c, nil
		}
		q.release()
	}
	c, err := acquireTx(ctx, e.cfg.Pool)
	if err != nil {
		return nil, err
	}
	q.conn = c
	return c, nil
}

// release rolls back whatever is open on q's connection and gives it back.
func (q *request) release() {
	if q.conn != nil {
		q.conn.release(q.r.Context())
		q.conn = nil
	}
}

func (q *request) attrs() []any {
	return []any{"operation", q.claim.Consumer, "tenant", q.claim.Tenant, "key", q.claim.Key}
}

// ended answers a request whose context ended before the commit: a client that
// went away gets nothing; a deadline gets a 503 it may still read.
func (e *engine) ended(q *request, err error) {
	if errors.Is(err, context.DeadlineExceeded) {
		e.log.Info("idem: request deadline passed before the commit; rolled back", q.attrs()...)
		q.fail(OutcomeTimeout, CodeTimeout, "the request took too long and was rolled back; retry with the same key", e.cfg.RetryAfter)
		return
	}
	e.log.Info("idem: client went away before the commit; rolled back", q.attrs()...)
	q.respond(OutcomeDisconnected, nil, false)
}

// answerFault answers a request whose response cannot be used; its work was rolled
// back.
func (e *engine) answerFault(q *request, f fault) {
	switch f {
	case faultCanceled:
		e.ended(q, q.r.Context().Err())
	case faultOverflow:
		e.log.Error("idem: response over MaxResponseBody; the request is rolled back", append(q.attrs(), "limit", e.cfg.MaxResponseBody)...)
		q.fail(OutcomeError, CodeResponseTooLarge, fmt.Sprintf("the response is over %d bytes and cannot be stored; the request was rolled back", e.cfg.MaxResponseBody), 0)
	case faultTxEnded:
		e.log.Error("idem: the request's transaction cannot commit (a failed statement the handler answered a success past, or a raw COMMIT/ROLLBACK with no key to record); it is rolled back and nothing is stored",
			q.attrs()...)
		q.fail(OutcomeError, CodeTransactionEnded, "the request's transaction failed or was ended by the handler; nothing of it was stored, and a retry runs the request again", 0)
	}
}

// saveFailed answers a request whose response could not be stored; tx rolls back.
func (e *engine) saveFailed(q *request, err error) {
	if q.r.Context().Err() != nil {
		e.ended(q, q.r.Context().Err())
		return
	}
	e.log.Error("idem: the response could not be stored; the request is rolled back", append(q.attrs(), "err", err)...)
	q.fail(OutcomeError, CodeHandlerFailed, "the response could not be stored; the request was rolled back", 0)
}

// notFinal answers with a response that is not stored; its work was rolled back.
func (e *engine) notFinal(q *request, resp *Response) {
	e.log.Info("idem: status is not final; the work is rolled back and a retry runs again", append(q.attrs(), "status", resp.Status)...)
	q.respond(OutcomeNotFinal, resp, false)
}

// answerExisting answers a request whose key has a row already. It gives the
// connection back first: a BodyReferencer may use the pool.
func (e *engine) answerExisting(q *request, res responseClaim) {
	q.release()
	rec := res.Existing
	switch {
	case res.Mismatch:
		e.log.Warn("idem: key reused with a different request", q.attrs()...)
		q.fail(OutcomeMismatch, CodeFingerprintMismatch, "this key was first used with a different request (method, path, query or body); use a new key for a new request", 0)
	case rec.State == inboxdb.StateProcessing:
		e.inProgress(q)
	case res.Response == nil:
		e.log.Error("idem: the key has an inbox row without a stored response; does a message consumer use this operation's name?", q.attrs()...)
		q.fail(OutcomeError, CodeResponseNotStored, "this key was settled without a stored response", 0)
	default:
		e.replay(q, rec, res.Response)
	}
}

// replay answers with the key's stored response.
func (e *engine) replay(q *request, rec *inboxdb.Record, stored *storedResponse) {
	body := stored.Body
	if stored.BodyRef != "" {
		var err error
		if e.cfg.BodyReference == nil {
			err = errors.New("a body reference is stored, but Config.BodyReference is not set")
		} else {
			body, err = e.cfg.BodyReference.Body(q.r.Context(), stored.BodyRef)
		}
		if err != nil {
			e.log.Error("idem: stored body reference could not be resolved", append(q.attrs(), "ref", stored.BodyRef, "err", err)...)
			q.fail(OutcomeError, CodeReplayFailed, "the stored response cannot be replayed", 0)
			return
		}
	}
	if rec.CompletedAt != nil {
		e.metrics.op(q.claim.Consumer).replayAge.Observe(rec.Now.Sub(*rec.CompletedAt).Seconds())
	}
	q.respond(OutcomeReplayed, &Response{Status: stored.Status, Header: http.Header(stored.Header), Body: body}, true)
}

func (e *engine) inProgress(q *request) {
	q.fail(OutcomeInProgress, CodeInProgress, "a request with this key is still running; retry after Retry-After", e.cfg.RetryAfter)
}

// dbFailed answers a request that Postgres failed before anything committed.
func (e *engine) dbFailed(q *request, what string, err error) {
	if q.r.Context().Err() != nil {
		e.ended(q, q.r.Context().Err())
		return
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == pgerrcode.LockNotAvailable {
		e.inProgress(q) // the wait for a concurrent request with the key ran out
		return
	}
	if errors.Is(err, inbox.ErrSchemaMissing) {
		e.log.Error("idem: "+what+" failed: the idem tables are missing; run `idem migrate up`", append(q.attrs(), "err", err)...)
	} else {
		e.log.Warn("idem: "+what+" failed; nothing ran", append(q.attrs(), "err", err)...)
	}
	q.fail(OutcomeError, CodeDatabaseUnavailable, "the request could not be run now; retry with the same key", e.cfg.RetryAfter)
}
