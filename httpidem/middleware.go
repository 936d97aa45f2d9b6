package httpidem

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"runtime/debug"
	"strconv"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/citusmode"
	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/tracing"
	"github.com/idemkit/idem/internal/txmark"
)

// Middleware is the Idempotency-Key middleware. Wrap each route's handler with
// Middleware (or Route, for per-route options). It is safe for concurrent use.
type Middleware struct {
	cfg     Config
	store   *responseStore
	metrics *metrics
	log     *slog.Logger
	tracer  trace.Tracer
	// claimPrelude goes with the claim in its round trip: BEGIN.
	claimPrelude []string
	// storedNames are cfg.StoredHeaders, canonical, sorted and unique.
	storedNames []string
	// fingerprint is DefaultFingerprint(cfg.Fields).
	fingerprint func(r *http.Request, body []byte) ([]byte, error)
	// prepared, if set, are the statements of transactional mode's two round
	// trips, sent through pgconn (see preparedStmts).
	prepared *preparedStmts

	// afterCommit, if set, runs after a commit and before the answer is written
	// (tests kill the process there).
	afterCommit func(r *http.Request)
	// onLeaseWait, if set, runs when a lease-mode request starts to wait for a held
	// key (tests).
	onLeaseWait func(r *http.Request)

	// shards, with a shard map, routes each request to its shard's Middleware.
	shards *shardSet

	// citus: whether the schema is distributed by Citus, asked on the first
	// request (onCitus).
	citus citusmode.Detector
}

// onCitus reports whether the schema is distributed by Citus (internal/citusmode),
// asking the database through conn (the request's connection, outside any
// transaction) on the first call; false while it cannot ask. On Citus every
// transaction sends citusmode.PropagateSet right after BEGIN, so that its SET
// LOCAL statements (lock_timeout, txmark.Mark) reach the workers, and the claim
// goes without the prepared statements, whose claim sets them with set_config,
// which Citus applies on the coordinator only.
func (m *Middleware) onCitus(ctx context.Context, conn *pgx.Conn) bool {
	if on, known := m.citus.Known(); known {
		return on
	}
	on, err := m.citus.On(ctx, conn, pgschema.Table(m.cfg.Schema, "inbox"))
	return err == nil && on
}

// citusClaimPrelude is the claim's prelude on Citus: BEGIN, then the settings as
// SET LOCAL statements that reach the workers.
func citusClaimPrelude(wait time.Duration) []string {
	return []string{beginSQL, citusmode.PropagateSet, lockTimeoutSQL(wait), txmark.Mark}
}

// New validates cfg and returns a Middleware.
func New(cfg Config) (*Middleware, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	if cfg.Shards != nil {
		return newSharded(cfg)
	}
	store, err := newResponseStore(cfg.Schema)
	if err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	met, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, fmt.Errorf("register metrics: %w", err)
	}
	m := &Middleware{cfg: cfg, store: store, metrics: met, log: cfg.Logger,
		tracer:       tracing.Tracer(cfg.TracerProvider),
		claimPrelude: []string{beginSQL},
		fingerprint:  DefaultFingerprint(cfg.Fields),
		storedNames:  storedNames(cfg.StoredHeaders),
	}
	if usePrepared(cfg.Pool.Config().ConnConfig) {
		m.prepared = newPreparedStmts(store)
	}
	return m, nil
}

// lockTimeoutSQL bounds the wait for a concurrent request with the key. SET LOCAL
// takes no bind parameters; the value is an integer we format.
func lockTimeoutSQL(wait time.Duration) string {
	return "SET LOCAL lock_timeout = " + strconv.FormatInt(max(wait.Milliseconds(), 1), 10)
}

// Middleware wraps one route's handler with the Config's defaults. It is a
// func(http.Handler) http.Handler, for http.ServeMux, chi's With and the like.
func (m *Middleware) Middleware(next http.Handler) http.Handler { return m.Route(Route{})(next) }

// Route returns the middleware with rt's options for one route. It panics if
// rt.Operation is not a valid inbox consumer name, as http.ServeMux panics on a bad
// pattern: it is a programming error, found at start-up.
func (m *Middleware) Route(rt Route) func(http.Handler) http.Handler {
	if rt.Operation != "" {
		if err := inbox.ValidateConsumer(rt.Operation); err != nil {
			panic(fmt.Sprintf("httpidem: Route.Operation %q: %v", rt.Operation, err))
		}
		for _, one := range m.parts() {
			one.metrics.op(rt.Operation) // every shard's series, under its name
		}
	}
	if m.shards != nil {
		return func(next http.Handler) http.Handler { return m.shards.route(rt, next) }
	}
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { m.serve(rt, next, w, r) })
	}
}

type txKey struct{}

type keyKey struct{}

// ownedTx is the transaction a handler sees: idem commits it after the response is
// stored in it, so Commit and Rollback are refused. Answer with a status that is
// not final (or panic) to roll back.
type ownedTx struct{ pgx.Tx }

// bodyReader is the request body given back to the handler.
type bodyReader struct{ bytes.Reader }

func (*bodyReader) Close() error { return nil }

// ErrTxOwned is returned when the handler calls Commit or Rollback on the
// transaction idem gave it. Its code is the consumer's for the same mistake.
var ErrTxOwned = errcode.Transient("tx_owned", "the request's transaction belongs to httpidem: answer with a final status to commit, with any other status to roll back")

func (ownedTx) Commit(context.Context) error   { return ErrTxOwned }
func (ownedTx) Rollback(context.Context) error { return ErrTxOwned }

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

// ErrNoTx is what Tx panics with, and TxSafely returns, for a context without
// httpidem's transaction. Its code is the consumer's for the same mistake.
var ErrNoTx = errcode.Transient("no_transaction", "no httpidem transaction in this context: httpidem's middleware is not around this handler (wrap it: mux.Handle(pattern, idem.Middleware(h))), "+
	"or the request passed through untouched (a safe method), or ctx is not the request's (r.Context()); use httpidem.TxSafely where no transaction is expected")

// KeyFrom returns the request's inbox identity (operation, tenant, key), for a
// handler to pass on as the idempotency key of a provider it calls. The second
// result is false for a request without a key.
func KeyFrom(ctx context.Context) (inbox.ID, bool) {
	id, ok := ctx.Value(keyKey{}).(inbox.ID)
	return id, ok
}

// request is one keyed request on its way through the inbox.
type request struct {
	w     http.ResponseWriter
	r     *http.Request
	next  http.Handler
	body  []byte
	claim inbox.Claim
	// stmts are the prepared statements on conn, when the middleware uses them
	// (prepared).
	stmts    described
	prepared bool
	// owned is the transaction the handler gets (Tx), rec holds its answer, and
	// bodyReader gives it the body again.
	owned      ownedTx
	rec        recorder
	bodyReader bodyReader
	// conn is the one pool connection the request holds, or nil. Every statement
	// of the request runs on it (acquire), and every answer is written after it
	// went back to the pool (send, problem): a request never holds two
	// connections, and never holds one while a slow client reads its answer.
	conn *connTx
}

// acquire returns q's connection, open and outside any transaction: the one q
// holds if it is, otherwise a new one from the pool, acquired only after the old
// one went back to it.
func (m *Middleware) acquire(ctx context.Context, q *request) (*connTx, error) {
	if c := q.conn; c != nil {
		if !c.conn.IsClosed() && !c.inTx() {
			return c, nil
		}
		q.release()
	}
	c, err := acquireTx(ctx, m.cfg.Pool)
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

// send writes resp to the client, after giving the connection back.
func (q *request) send(resp *Response, replayed bool) {
	q.release()
	writeResponse(q.w, resp, replayed)
}

// problem writes idem's problem for code to the client, after giving the
// connection back.
func (q *request) problem(code, detail string, retryAfter time.Duration) {
	q.release()
	writeProblem(q.w, code, detail, retryAfter)
}

func (q *request) attrs() []any {
	return []any{"operation", q.claim.Consumer, "tenant", q.claim.Tenant, "key", q.claim.Key}
}

func (m *Middleware) count(op, outcome string) {
	m.metrics.op(op).requests[outcome].Inc()
}

func (m *Middleware) serve(rt Route, next http.Handler, w http.ResponseWriter, r *http.Request) {
	if safeMethod(r.Method) && !rt.SafeMethods {
		next.ServeHTTP(w, r) // a read: nothing to run once, and a stored one would be replayed stale
		return
	}
	op := rt.Operation
	if op == "" {
		var err error
		if op, err = m.cfg.Operation(r); err == nil {
			err = inbox.ValidateConsumer(op)
		}
		if err != nil {
			m.log.Error("idem: request without an operation; set Route.Operation or Config.Operation", "err", err, "method", r.Method, "path", r.URL.Path)
			writeProblem(w, CodeNoOperation, "the server cannot name this request's operation", 0)
			return
		}
	}
	m.metrics.op(op)

	key, err := parseKey(r.Header.Values(m.cfg.KeyHeader))
	switch {
	case errors.Is(err, errKeyAbsent):
		if rt.KeyOptional || m.cfg.KeyOptional {
			m.serveUnkeyed(op, next, w, r)
			return
		}
		m.reject(w, op, CodeKeyMissing, "send an "+m.cfg.KeyHeader+" header: a unique value (a UUID) per operation, the same on every retry of it")
		return
	case err != nil:
		m.reject(w, op, CodeKeyInvalid, err.Error())
		return
	}
	q := &request{w: w, r: r, next: next, claim: inbox.Claim{ID: inbox.ID{Consumer: op, Key: key}, Retention: m.cfg.Retention}}
	defer q.release()
	if m.cfg.Tenant != nil {
		tenant, err := m.cfg.Tenant(r)
		if err == nil && tenant == "" {
			err = errEmptyTenant
		}
		if err == nil {
			err = inbox.ValidateTenant(tenant)
		}
		if err != nil {
			m.log.Info("idem: tenant refused", append(q.attrs(), "err", err)...)
			m.reject(w, op, CodeTenantInvalid, "the request's tenant could not be determined")
			return
		}
		q.claim.Tenant = tenant
	}
	if q.body, err = readBody(r, m.cfg.MaxRequestBody); err != nil {
		if errors.Is(err, errBodyTooLarge) {
			m.reject(w, op, CodeRequestTooLarge, fmt.Sprintf("the body is over %d bytes; nothing was run", m.cfg.MaxRequestBody))
		} else {
			m.reject(w, op, CodeBodyUnreadable, "the request body could not be read")
		}
		return
	}
	if m.cfg.Fingerprint != nil {
		q.claim.Fingerprint, err = m.cfg.Fingerprint(fingerprintView(r, m.cfg.KeyHeader), q.body)
		if err != nil {
			m.log.Info("idem: fingerprint failed", append(q.attrs(), "err", err)...)
			m.reject(w, op, CodeFingerprintFailed, "the request cannot be fingerprinted")
			return
		}
	} else if q.claim.Fingerprint, err = m.fingerprint(r, q.body); err != nil {
		m.reject(w, op, CodeBodyNotJSON, err.Error())
		return
	}
	if rt.Lease {
		m.serveLease(q)
		return
	}
	m.serveTx(q)
}

// errEmptyTenant: Config.Tenant returned "", which would put the request's key in
// the unscoped space that Unscoped opts into.
var errEmptyTenant = errors.New("Config.Tenant returned an empty tenant")

func (m *Middleware) reject(w http.ResponseWriter, op, code, detail string) {
	m.count(op, OutcomeRejected)
	writeProblem(w, code, detail, 0)
}

// serveTx is the transactional mode: claim, handler, stored response and commit in
// one transaction, in as many round trips as a bare handler's BEGIN, write and
// COMMIT: BEGIN goes with the claim, COMMIT with the stored response. The answer
// goes out after the commit.
func (m *Middleware) serveTx(q *request) {
	ctx := q.r.Context()
	tx, err := m.acquire(ctx, q)
	if err != nil {
		m.dbFailed(q, "acquire a connection", err)
		return
	}
	cctx, span := m.startClaim(q)
	start := time.Now()
	var res responseClaim
	wait := max(m.cfg.LockTimeout, time.Millisecond)
	switch citus := m.onCitus(cctx, tx.conn); {
	case citus:
		res, err = m.store.ClaimResponseTx(cctx, tx, citusClaimPrelude(wait), q.claim, wait)
	case m.prepared != nil:
		res, q.stmts, err = m.store.ClaimResponsePrepared(cctx, tx.conn, m.prepared, q.claim, wait)
		q.prepared = true
	default:
		res, err = m.store.ClaimResponseTx(cctx, tx, m.claimPrelude, q.claim, wait)
	}
	m.metrics.op(q.claim.Consumer).lockWait.Observe(time.Since(start).Seconds())
	endClaim(span, res.ClaimResult, err)
	if err != nil {
		m.dbFailed(q, "claim", err)
		return
	}
	m.noteExpired(q, res)
	if !res.Claimed {
		m.answerExisting(q, res)
		return
	}

	resp, f := m.run(q, tx, func() { m.rollBack(q, tx, 0) })
	if f == faultNone && m.success(resp.Status) {
		m.commitTx(q, tx, res.Row, resp)
		return
	}
	if answer := m.rollBack(q, tx, 0); answer != nil {
		answer()
		return
	}
	switch {
	case f != faultNone:
		m.answerFault(q, f)
	case m.final(resp.Status):
		m.storeFailure(q, resp)
	default:
		m.notFinal(q, resp)
	}
}

// commitTx stores a success response in tx and commits, then answers.
func (m *Middleware) commitTx(q *request, tx *connTx, row rowRef, resp *Response) {
	ctx := q.r.Context()
	stored, err := m.toStored(q, tx, resp)
	if err == nil && ctx.Err() == nil {
		// Never cancelled once sent: a client leaving mid-commit must not turn a
		// commit into an unknown.
		cctx, span := m.child(context.WithoutCancel(ctx), spanCommit)
		if q.prepared {
			err = m.store.saveCommitPrepared(cctx, tx.conn, q.stmts, q.claim.ID, row, stored)
		} else {
			err = m.store.SaveResponseCommit(cctx, tx.conn, q.claim.ID, row, stored)
		}
		err = tx.noteEnded(err)
		endSpan(span, err)
		if err == nil || errors.Is(err, txmark.ErrCommitUnknown) {
			m.committed(q, resp, err, OutcomeCommitted)
			return
		}
	}
	// Nothing committed by idem. Did the handler commit the claim itself?
	if answer := m.rollBack(q, tx, 0); answer != nil {
		answer()
		return
	}
	switch {
	case errors.Is(err, txmark.ErrTxReplaced):
		m.answerFault(q, faultTxEnded)
	case err == nil:
		m.ended(q, ctx.Err())
	default:
		m.saveFailed(q, err)
	}
}

// committed answers after a commit attempt: the response if it committed, 503 if
// the outcome is unknown, 500 if the response was not saved (nothing committed).
func (m *Middleware) committed(q *request, resp *Response, err error, outcome string) {
	switch {
	case err == nil:
		if m.afterCommit != nil {
			m.afterCommit(q.r)
		}
		m.count(q.claim.Consumer, outcome)
		q.send(resp, false)
	case errors.Is(err, txmark.ErrCommitUnknown):
		m.count(q.claim.Consumer, OutcomeError)
		m.log.Warn("idem: COMMIT failed; whether the request took effect is unknown until a retry with the same key",
			append(q.attrs(), "err", err)...)
		q.problem(CodeCommitUnknown, "the outcome is unknown; retry with the same key to learn it", m.cfg.RetryAfter)
	default:
		m.saveFailed(q, err)
	}
}

// rollBack rolls back what is open on tx after the handler ran. If the handler
// ended idem's transaction itself (a raw COMMIT or ROLLBACK, with or without a
// BEGIN after it), or a statement failed in it (after which the mark cannot be
// asked), the database tells whether the request's work committed: in
// transactional mode the key's claim row, in lease mode (fence > 0) the status of
// the transaction's ID. Work that committed settles the key with the stored
// handler_committed problem. A handler that ended the transaction without its
// work committing (a ROLLBACK) settles it with the stored handler_ended_transaction
// problem, recorded as failed in a fresh transaction: what it wrote after the
// ROLLBACK committed on its own, so it must not run again. Either way every retry
// gets a stable, coded answer and none runs the handler again. A transaction that
// merely failed on a statement, with nothing committed, settles nothing: a retry
// runs the request again. Everything runs on the request's one connection.
//
// It returns nil when nothing of the request committed and nothing was settled,
// and otherwise the answer to give: the stored problem; the key's answer if
// another request settled it meanwhile (after a ROLLBACK freed the key); 409 if
// the lease was lost, or a concurrent request still holds the key; 503
// commit_unknown if the database could not say whether the work committed; 500
// transaction_ended if the ended key could not be recorded.
func (m *Middleware) rollBack(q *request, tx *connTx, fence int64) (answer func()) {
	end := tx.rollbackMarked(q.r.Context())
	if end == txOpen {
		return nil // idem's transaction was still open: rolled back, nothing committed
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(q.r.Context()), settleTimeout)
	defer cancel()
	xid := tx.xid
	// The same connection, now outside any transaction (or a new one, if the
	// rollback closed it).
	conn, err := m.acquire(ctx, q)
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
		ok, err = m.store.AnswerCommitted(ctx, conn.conn, q.claim, fence, CodeHandlerCommitted,
			"the handler committed the request's transaction itself (raw SQL); its answer could not be stored",
			&storedResponse{Status: stored.Status, Header: stored.Header, Body: stored.Body})
		switch {
		case err == nil && ok:
			m.log.Error("idem: the handler committed the request's transaction itself (raw COMMIT): its work committed without its answer, so the key is settled with a stored handler_committed problem, and a transaction it began after that was rolled back. Never end the transaction httpidem.Tx gives",
				q.attrs()...)
			return func() {
				m.count(q.claim.Consumer, OutcomeError)
				q.send(stored, false)
			}
		case err == nil && fence > 0:
			m.log.Error("idem: the handler committed the request's transaction itself (raw COMMIT), and its lease was lost meanwhile", q.attrs()...)
			return func() { m.inProgress(q) }
		}
		// Transactional mode, and the claim did not commit: the handler rolled it
		// back, or a statement failed in idem's transaction.
	}
	if err != nil {
		m.log.Error("idem: the handler ended or broke the request's transaction, and whether its work committed could not be read; a retry with the key settles it",
			append(q.attrs(), "err", err)...)
		return func() {
			m.count(q.claim.Consumer, OutcomeError)
			q.problem(CodeCommitUnknown, "the outcome is unknown; retry with the same key to learn it", m.cfg.RetryAfter)
		}
	}
	if end != txEnded {
		return nil // a statement failed and nothing committed: the retry runs again
	}
	return m.settleEnded(ctx, q, conn, fence)
}

// settleEnded records q's key as failed with the stored handler_ended_transaction
// problem, after its handler ended idem's transaction without its work committing:
// in transactional mode in a fresh transaction on conn (if another request has
// claimed the key since the handler's ROLLBACK freed it, that request's outcome is
// the answer), in lease mode on the lease row, fenced.
func (m *Middleware) settleEnded(ctx context.Context, q *request, conn *connTx, fence int64) (answer func()) {
	const msg = "the handler ended the request's transaction itself (raw ROLLBACK or COMMIT); what it wrote after that committed on its own"
	p := problemResponse(CodeHandlerEndedTransaction, handlerEndedDetail, 0)
	stored := &storedResponse{Status: p.Status, Header: p.Header, Body: p.Body}
	var (
		res responseClaim
		err error
	)
	if fence > 0 {
		err = m.store.FailLeaseResponse(ctx, conn.conn, q.claim.ID, fence, m.cfg.Retention, CodeHandlerEndedTransaction, msg, stored)
		res.Claimed = err == nil
	} else {
		res, err = m.recordFailure(ctx, conn, q.claim, CodeHandlerEndedTransaction, msg, stored)
	}
	var pgErr *pgconn.PgError
	switch {
	case errors.Is(err, inbox.ErrLeaseLost), errors.As(err, &pgErr) && pgErr.Code == pgerrcode.LockNotAvailable:
		// A newer holder, or a concurrent request with the key: its answer is the
		// key's.
		m.log.Error("idem: the handler ended the request's transaction itself (raw ROLLBACK or COMMIT), and another request holds its key now", q.attrs()...)
		return func() { m.inProgress(q) }
	case err != nil:
		m.log.Error("idem: the handler ended the request's transaction itself (raw ROLLBACK or COMMIT), and its key could not be recorded: a retry runs it again. Never end the transaction httpidem.Tx gives",
			append(q.attrs(), "err", err)...)
		return func() {
			m.count(q.claim.Consumer, OutcomeError)
			q.problem(CodeTransactionEnded, "the handler ended the request's transaction, and its key could not be recorded; nothing was stored, and a retry runs the request again", 0)
		}
	case !res.Claimed:
		m.log.Error("idem: the handler ended the request's transaction itself (raw ROLLBACK or COMMIT), and another request settled its key meanwhile", q.attrs()...)
		return func() { m.answerExisting(q, res) }
	}
	m.log.Error("idem: the handler ended the request's transaction itself (raw ROLLBACK or COMMIT): what it wrote after that committed on its own, so the key is recorded as failed with a stored handler_ended_transaction problem and never runs again. Never end the transaction httpidem.Tx gives",
		q.attrs()...)
	return func() {
		m.count(q.claim.Consumer, OutcomeError)
		q.send(p, false)
	}
}

// final reports whether a status is stored; 5xx never is.
func (m *Middleware) final(status int) bool { return status < 500 && m.cfg.FinalStatus(status) }

// success reports whether a status commits the handler's work.
func (m *Middleware) success(status int) bool { return status < 400 && m.final(status) }

// fault is what kept a handler's response from being used.
type fault int

const (
	faultNone     fault = iota
	faultCanceled       // the request's context ended
	faultOverflow       // the response is over MaxResponseBody
	faultTxEnded        // a success, and the transaction is not open and healthy
)

// run runs the handler with tx in its context and returns its response, or the
// fault that keeps it from being used. It answers nothing and ends nothing: the
// caller rolls back or commits, and answers. A panic calls onPanic (which rolls
// back) and panics on.
func (m *Middleware) run(q *request, tx pgx.Tx, onPanic func()) (*Response, fault) {
	ctx := q.r.Context()
	sctx, span := m.child(ctx, spanHandler)
	defer span.End()
	hr := q.r.WithContext(m.handlerContext(sctx, q, tx))
	if q.body != nil {
		q.bodyReader.Reset(q.body)
		hr.Body = &q.bodyReader
	}
	q.rec = recorder{under: q.w, header: http.Header{}, limit: m.cfg.MaxResponseBody}
	rec := &q.rec
	func() {
		defer func() {
			if v := recover(); v != nil {
				onPanic()
				m.count(q.claim.Consumer, OutcomePanic)
				if err, _ := v.(error); !errors.Is(err, http.ErrAbortHandler) {
					m.log.Error("idem: handler panicked; its work is rolled back and nothing is stored",
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
	if m.success(resp.Status) && tx.Conn().PgConn().TxStatus() != 'T' {
		return resp, faultTxEnded
	}
	return resp, faultNone
}

// handlerContext is the context the handler (and Recover) runs with: the
// transaction (Tx), the key (KeyFrom) and the effects scope.
func (m *Middleware) handlerContext(ctx context.Context, q *request, tx pgx.Tx) context.Context {
	scope := effects.Scope{Schema: m.cfg.Schema, Kinds: m.cfg.EffectKinds}
	if q.claim.Key != "" {
		scope.Source = effects.Source{Consumer: q.claim.Consumer, Tenant: q.claim.Tenant, Key: q.claim.Key}
	}
	q.owned = ownedTx{tx}
	return &handlerCtx{Context: effects.WithScope(ctx, scope), q: q}
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
			return c.q.claim.ID
		}
	}
	return c.Context.Value(key)
}

// answerFault answers a request whose response cannot be used; its work was rolled
// back.
func (m *Middleware) answerFault(q *request, f fault) {
	switch f {
	case faultCanceled:
		m.ended(q, q.r.Context().Err())
	case faultOverflow:
		m.count(q.claim.Consumer, OutcomeError)
		m.log.Error("idem: response over MaxResponseBody; the request is rolled back", append(q.attrs(), "limit", m.cfg.MaxResponseBody)...)
		q.problem(CodeResponseTooLarge, fmt.Sprintf("the response is over %d bytes and cannot be stored; the request was rolled back", m.cfg.MaxResponseBody), 0)
	case faultTxEnded:
		m.count(q.claim.Consumer, OutcomeError)
		m.log.Error("idem: the request's transaction cannot commit (a failed statement the handler answered a success past, or a raw COMMIT/ROLLBACK with no key to record); it is rolled back and nothing is stored",
			q.attrs()...)
		q.problem(CodeTransactionEnded, "the request's transaction failed or was ended by the handler; nothing of it was stored, and a retry runs the request again", 0)
	}
}

// ended answers a request whose context ended before the commit: a client that
// went away gets nothing; a deadline gets a 503 it may still read.
func (m *Middleware) ended(q *request, err error) {
	if errors.Is(err, context.DeadlineExceeded) {
		m.count(q.claim.Consumer, OutcomeTimeout)
		m.log.Info("idem: request deadline passed before the commit; rolled back", q.attrs()...)
		q.problem(CodeTimeout, "the request took too long and was rolled back; retry with the same key", m.cfg.RetryAfter)
		return
	}
	m.count(q.claim.Consumer, OutcomeDisconnected)
	m.log.Info("idem: client went away before the commit; rolled back", q.attrs()...)
}

// toStored is what is stored of resp: the allow-listed headers and the body, or a
// reference to it.
func (m *Middleware) toStored(q *request, tx pgx.Tx, resp *Response) (*storedResponse, error) {
	stored := toStoredResponse(resp, m.storedNames)
	if m.cfg.BodyReference != nil && resp.Status < 400 {
		ctx := context.WithValue(q.r.Context(), txKey{}, ownedTx{tx})
		ref, err := m.cfg.BodyReference.Reference(ctx, q.r, resp)
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

// saveFailed answers a request whose response could not be stored; tx rolls back.
func (m *Middleware) saveFailed(q *request, err error) {
	if q.r.Context().Err() != nil {
		m.ended(q, q.r.Context().Err())
		return
	}
	m.count(q.claim.Consumer, OutcomeError)
	m.log.Error("idem: the response could not be stored; the request is rolled back", append(q.attrs(), "err", err)...)
	q.problem(CodeHandlerFailed, "the response could not be stored; the request was rolled back", 0)
}

// storeFailure records a final client error with its response, in a transaction of
// its own on the request's connection after the handler's rolled back; if another
// request settled the key meanwhile, that outcome is the answer.
func (m *Middleware) storeFailure(q *request, resp *Response) {
	ctx := q.r.Context()
	stored := toStoredResponse(resp, m.storedNames)
	conn, err := m.acquire(ctx, q)
	var res responseClaim
	if err == nil {
		res, err = m.recordFailure(ctx, conn, q.claim, "http_"+strconv.Itoa(resp.Status), http.StatusText(resp.Status), stored)
	}
	if err != nil {
		m.dbFailed(q, "record the final client error", err)
		return
	}
	if !res.Claimed {
		m.answerExisting(q, res)
		return
	}
	m.count(q.claim.Consumer, OutcomeFailed)
	q.send(resp, false)
}

// recordFailure records c as failed with code, msg and stored, in a transaction of
// its own on conn (outside any transaction), waiting up to LockTimeout for a concurrent
// request with the key; if the key has a row, it returns that instead.
func (m *Middleware) recordFailure(ctx context.Context, conn *connTx, c inbox.Claim, code, msg string, stored *storedResponse) (res responseClaim, err error) {
	opts := pgx.TxOptions{IsoLevel: pgx.ReadCommitted}
	if m.onCitus(ctx, conn.conn) {
		opts.BeginQuery = citusmode.Begin(opts.IsoLevel)
	}
	err = pgx.BeginTxFunc(ctx, conn.conn, opts, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, lockTimeoutSQL(m.cfg.LockTimeout)); err != nil {
			return err
		}
		var err error
		res, err = m.store.FailResponseTx(ctx, tx, c, code, msg, stored)
		return err
	})
	return res, err
}

// notFinal sends a response that is not stored; its work was rolled back.
func (m *Middleware) notFinal(q *request, resp *Response) {
	m.count(q.claim.Consumer, OutcomeNotFinal)
	m.log.Info("idem: status is not final; the work is rolled back and a retry runs again", append(q.attrs(), "status", resp.Status)...)
	q.send(resp, false)
}

// answerExisting answers a request whose key has a row already. It gives the
// connection back first: a BodyReferencer may use the pool.
func (m *Middleware) answerExisting(q *request, res responseClaim) {
	q.release()
	rec := res.Existing
	switch {
	case res.Mismatch:
		m.count(q.claim.Consumer, OutcomeMismatch)
		m.log.Warn("idem: key reused with a different request", q.attrs()...)
		q.problem(CodeFingerprintMismatch, "this key was first used with a different request (method, path, query or body); use a new key for a new request", 0)
	case rec.State == inbox.StateProcessing:
		m.inProgress(q)
	case res.Response == nil:
		m.count(q.claim.Consumer, OutcomeError)
		m.log.Error("idem: the key has an inbox row without a stored response; does a message consumer use this operation's name?", q.attrs()...)
		q.problem(CodeResponseNotStored, "this key was settled without a stored response", 0)
	default:
		m.replay(q, rec, res.Response)
	}
}

func (m *Middleware) replay(q *request, rec *inbox.Record, stored *storedResponse) {
	body := stored.Body
	if stored.BodyRef != "" {
		var err error
		if m.cfg.BodyReference == nil {
			err = errors.New("a body reference is stored, but Config.BodyReference is not set")
		} else {
			body, err = m.cfg.BodyReference.Body(q.r.Context(), stored.BodyRef)
		}
		if err != nil {
			m.count(q.claim.Consumer, OutcomeError)
			m.log.Error("idem: stored body reference could not be resolved", append(q.attrs(), "ref", stored.BodyRef, "err", err)...)
			q.problem(CodeReplayFailed, "the stored response cannot be replayed", 0)
			return
		}
	}
	if rec.CompletedAt != nil {
		m.metrics.op(q.claim.Consumer).replayAge.Observe(rec.Now.Sub(*rec.CompletedAt).Seconds())
	}
	m.count(q.claim.Consumer, OutcomeReplayed)
	q.send(&Response{Status: stored.Status, Header: http.Header(stored.Header), Body: body}, true)
}

func (m *Middleware) inProgress(q *request) {
	m.count(q.claim.Consumer, OutcomeInProgress)
	q.problem(CodeInProgress, "a request with this key is still running; retry after Retry-After", m.cfg.RetryAfter)
}

func (m *Middleware) noteExpired(q *request, res responseClaim) {
	if res.ReplacedExpired {
		m.metrics.op(q.claim.Consumer).expired.Inc()
		m.log.Info("idem: key reused after its retention; running it as a new request", q.attrs()...)
	}
}

// dbFailed answers a request that Postgres failed before anything committed.
func (m *Middleware) dbFailed(q *request, what string, err error) {
	if q.r.Context().Err() != nil {
		m.ended(q, q.r.Context().Err())
		return
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == pgerrcode.LockNotAvailable {
		m.inProgress(q) // the wait for a concurrent request with the key ran out
		return
	}
	m.count(q.claim.Consumer, OutcomeError)
	if errors.Is(err, inbox.ErrSchemaMissing) {
		m.log.Error("idem: "+what+" failed: the idem tables are missing; run `idem migrate up`", append(q.attrs(), "err", err)...)
	} else {
		m.log.Warn("idem: "+what+" failed; nothing ran", append(q.attrs(), "err", err)...)
	}
	q.problem(CodeDatabaseUnavailable, "the request could not be run now; retry with the same key", m.cfg.RetryAfter)
}

// serveUnkeyed runs a request without a key on a route where the key is optional:
// in a transaction, committed before the answer, with nothing stored.
func (m *Middleware) serveUnkeyed(op string, next http.Handler, w http.ResponseWriter, r *http.Request) {
	q := &request{w: w, r: r, next: next, claim: inbox.Claim{ID: inbox.ID{Consumer: op}}}
	defer q.release()
	ctx := r.Context()
	tx, err := m.begin(ctx, q, false)
	if err != nil {
		m.dbFailed(q, "begin", err)
		return
	}
	resp, f := m.run(q, tx, func() { tx.rollbackMarked(ctx) })
	switch {
	case f != faultNone:
		m.answerFault(q, f)
		return
	case !m.success(resp.Status):
		m.notFinal(q, resp)
		return
	case ctx.Err() != nil:
		m.ended(q, ctx.Err())
		return
	}
	err = tx.Commit(context.WithoutCancel(ctx))
	switch {
	case errors.Is(err, txmark.ErrTxReplaced):
		m.answerFault(q, faultTxEnded)
		return
	case err != nil:
		m.count(op, OutcomeError)
		m.log.Warn("idem: COMMIT failed for a request without a key; its outcome is unknown", "operation", op, "err", err)
		q.problem(CodeCommitUnknown, "the outcome is unknown", m.cfg.RetryAfter)
		return
	}
	m.count(op, OutcomeUnkeyed)
	q.send(resp, false)
}

// begin begins a transaction on q's connection (acquired if q holds none), marked
// with txmark.Mark, in one round trip; withXID also takes the transaction's ID
// (lease mode, where rollBack needs it).
func (m *Middleware) begin(ctx context.Context, q *request, withXID bool) (*connTx, error) {
	tx, err := m.acquire(ctx, q)
	if err != nil {
		return nil, err
	}
	b := &pgx.Batch{}
	b.Queue(beginSQL)
	citus := m.onCitus(ctx, tx.conn)
	if citus {
		b.Queue(citusmode.PropagateSet)
	}
	b.Queue(txmark.Mark)
	if withXID {
		b.Queue(xidSQL)
	}
	br := tx.conn.SendBatch(ctx, b)
	_, err = br.Exec()
	if err == nil && citus {
		_, err = br.Exec()
	}
	if err == nil {
		_, err = br.Exec()
	}
	if err == nil && withXID {
		err = br.QueryRow().Scan(&tx.xid)
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		q.release()
		return nil, err
	}
	return tx, nil
}
