package httpidem

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"runtime/debug"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/effectsdb"
)

type txKey struct{}

type keyKey struct{}

// ownedTx is the transaction a handler sees: idem commits it after the response is
// stored in it, so Commit and Rollback are refused. Answer with a status that is
// not final (or panic) to roll back.
type ownedTx struct{ pgx.Tx }

func (ownedTx) Commit(context.Context) error   { return ErrTxOwned }
func (ownedTx) Rollback(context.Context) error { return ErrTxOwned }

// bodyReader is the request body given back to the handler.
type bodyReader struct{ bytes.Reader }

func (*bodyReader) Close() error { return nil }

// Tx returns the transaction idem opened for the request being handled. Business
// writes and effects.Enqueue go through it; it commits with the stored response.
//
// Outside httpidem's middleware there is no transaction, and Tx panics with
// ErrNoTx, whose text says what to fix: the middleware is not around this handler,
// or ctx is not the request's context. A request with a safe method (GET, HEAD,
// OPTIONS, TRACE) that passes through untouched has none either: a handler that
// serves both uses TxSafely, which returns the error instead.
func Tx(ctx context.Context) pgx.Tx {
	tx, err := TxSafely(ctx)
	if err != nil {
		panic(err)
	}
	return tx
}

// TxSafely is Tx, returning ErrNoTx (code "no_transaction") instead of panicking
// when ctx carries no httpidem transaction.
func TxSafely(ctx context.Context) (pgx.Tx, error) {
	if tx, _ := ctx.Value(txKey{}).(pgx.Tx); tx != nil {
		return tx, nil
	}
	return nil, ErrNoTx
}

// KeyFrom returns the request's inbox identity (operation, tenant, key), for a
// handler to pass on as the idempotency key of a provider it calls. The second
// result is false for a request without a key.
func KeyFrom(ctx context.Context) (inbox.ID, bool) {
	id, ok := ctx.Value(keyKey{}).(inbox.ID)
	return id, ok
}

// fault is what kept a handler's response from being used.
type fault int

const (
	faultNone     fault = iota
	faultCanceled       // the request's context ended
	faultOverflow       // the response is over MaxResponseBody
	faultTxEnded        // a success, and the transaction is not open and healthy
)

// final reports whether a status is stored; 5xx never is.
func (e *engine) final(status int) bool { return status < 500 && e.cfg.FinalStatus(status) }

// success reports whether a status commits the handler's work.
func (e *engine) success(status int) bool { return status < 400 && e.final(status) }

// run runs the handler in q's transaction and records its response (q.resp), or
// the fault that keeps it from being used (q.fault). In lease mode, a key taken
// over from an earlier attempt (fence above 1) is first put to Config.Lease.Recover,
// whose response, if it gives one, is used instead of running the handler. run
// answers nothing and ends nothing: settle commits or rolls back. A panic rolls
// back (abandon) and panics on.
func (e *engine) run(q *request) {
	if q.mode == modeLease && q.fence > 1 {
		e.askRecover(q)
	}
	if q.resp == nil && q.fault == faultNone && q.recoverErr == nil {
		q.resp, q.fault = e.handle(q)
	}
}

// handle runs the handler with q's transaction in its context and returns its
// response, or the fault that keeps it from being used.
func (e *engine) handle(q *request) (*Response, fault) {
	ctx := q.r.Context()
	sctx, span := e.child(ctx, spanHandler)
	defer span.End()
	hr := q.r.WithContext(e.handlerContext(sctx, q))
	if q.body != nil {
		q.bodyReader.Reset(q.body)
		hr.Body = &q.bodyReader
	}
	q.rec = recorder{under: q.w, header: http.Header{}, limit: e.cfg.MaxResponseBody}
	rec := &q.rec
	func() {
		defer func() {
			if v := recover(); v != nil {
				e.abandon(q)
				e.metrics.op(q.claim.Consumer).requests[OutcomePanic].Inc()
				if err, _ := v.(error); !errors.Is(err, http.ErrAbortHandler) {
					e.log.Error("idem: handler panicked; its work is rolled back and nothing is stored",
						append(q.attrs(), "panic", fmt.Sprint(v), "stack", string(debug.Stack()))...)
				}
				panic(v)
			}
		}()
		q.next.ServeHTTP(rec, hr)
	}()

	switch {
	case ctx.Err() != nil:
		return nil, faultCanceled
	case rec.overflow:
		return nil, faultOverflow
	}
	resp := rec.response()
	// Only a transaction that is still open and healthy can commit what the handler
	// meant: one it committed, rolled back (raw SQL) or broke with a failed
	// statement cannot. (One it replaced with a BEGIN of its own is open: the mark
	// checked with the COMMIT finds that out.) A final client error commits nothing
	// of the handler's work, so it needs no such transaction: a 422 answered past a
	// failed statement is stored like any other, after rollBack has found out
	// whether the handler ended the transaction itself.
	if e.success(resp.Status) && q.tx.Conn().PgConn().TxStatus() != 'T' {
		return resp, faultTxEnded
	}
	return resp, faultNone
}

// askRecover asks Config.Lease.Recover about a stale key (an earlier attempt held
// it and never settled it), with the request's transaction in its context as a
// handler has it, and records its decision: a response to settle with (q.resp,
// q.recovered), nil to run the handler again, or an error (q.recoverErr). A
// response is judged as a handler's is: it cannot be used if the request's context
// ended, nor if it is a success and the transaction is no longer open and healthy;
// and a nil one (run the handler) cannot be either then, since the handler would
// run outside idem's transaction. A panic rolls back (abandon) and panics on.
func (e *engine) askRecover(q *request) {
	decision := "rerun"
	defer func() {
		if decision == "" {
			return
		}
		e.metrics.op(q.claim.Consumer).stale[decision].Inc()
		if decision == "rerun" {
			e.log.Info("idem: running a stale key again", append(q.attrs(), "fence", q.fence)...)
		}
	}()
	if e.cfg.Lease.Recover == nil {
		return
	}
	ctx := q.r.Context()
	hctx := e.handlerContext(ctx, q)
	var resp *Response
	var err error
	func() {
		defer func() {
			if v := recover(); v != nil {
				decision = "" // counted as a panic, not as a decision
				e.abandon(q)
				e.metrics.op(q.claim.Consumer).requests[OutcomePanic].Inc()
				e.log.Error("idem: Recover panicked; its work is rolled back and the lease given back",
					append(q.attrs(), "panic", fmt.Sprint(v), "stack", string(debug.Stack()))...)
				panic(v)
			}
		}()
		id := q.claim.ID
		resp, err = e.cfg.Lease.Recover(hctx, Stale{Request: q.r, Operation: id.Consumer, Tenant: id.Tenant, Key: id.Key, Fence: q.fence})
	}()
	switch {
	case err != nil:
		decision, q.recoverErr = "error", err
	case ctx.Err() != nil:
		decision, q.fault = "error", faultCanceled
	case (resp == nil || e.success(resp.Status)) && q.tx.Conn().PgConn().TxStatus() != 'T':
		decision, q.fault = "error", faultTxEnded
	case resp != nil:
		decision, q.resp, q.recovered = "recovered", resp, true
		e.log.Info("idem: Recover settled a stale key without running the handler", append(q.attrs(), "fence", q.fence, "status", resp.Status)...)
	}
}

// abandon rolls back a request whose handler (or Recover) panicked: its work, and
// in lease mode the lease, unless the handler ended the transaction itself and
// the key is settled (rollBack). Nothing is answered: the panic goes on.
func (e *engine) abandon(q *request) {
	if q.mode == modeUnkeyed {
		q.tx.rollbackMarked(q.r.Context())
		return
	}
	if !e.rollBack(q) && q.mode == modeLease {
		e.releaseLease(q)
	}
}

// handlerContext is the context the handler (and Recover) runs with: the
// transaction (Tx), the key (KeyFrom) and the effects scope.
func (e *engine) handlerContext(ctx context.Context, q *request) context.Context {
	citus, _ := e.citus.Known() // asked at the request's claim
	scope := effectsdb.Scope{Schema: e.cfg.Schema, Kinds: e.cfg.EffectKinds, Citus: citus}
	if q.claim.Key != "" {
		scope.Source = effectsdb.Source{Consumer: q.claim.Consumer, Tenant: q.claim.Tenant, Key: q.claim.Key}
	}
	q.owned = ownedTx{q.tx}
	return &handlerCtx{Context: effectsdb.WithScope(ctx, scope), q: q}
}

// handlerCtx answers Tx and KeyFrom from the request itself, so that they cost no
// context (and boxed value) of their own.
type handlerCtx struct {
	context.Context
	q *request
}

func (c *handlerCtx) Value(key any) any {
	switch key.(type) {
	case txKey:
		return &c.q.owned
	case keyKey:
		if c.q.claim.Key != "" {
			return inbox.ID(c.q.claim.ID)
		}
	}
	return c.Context.Value(key)
}
