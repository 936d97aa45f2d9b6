package httpidem

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/citusmode"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/txmark"
)

// claim claims q's key on e's database and opens the transaction the handler runs
// in (q.tx). It reports whether the request goes on to run; if not, its answer is
// recorded: the key's stored answer, 422, 409, or 503.
//
// Transactional mode claims in the handler's transaction, in as many round trips
// as a bare handler's BEGIN, write and COMMIT: BEGIN goes with the claim (and
// COMMIT, later, with the stored response). Lease mode commits the key first, as
// processing with a lease and a fence, on a pool connection that goes straight
// back (a request that finds a fresh lease waits for it without a connection, up
// to LockTimeout), then begins the handler's transaction. A request without a key
// only begins its transaction.
func (e *engine) claim(q *request) bool {
	ctx := q.r.Context()
	switch q.mode {
	case modeUnkeyed:
		tx, err := e.begin(ctx, q, false)
		if err != nil {
			e.dbFailed(q, "begin", err)
			return false
		}
		q.tx = tx
		return true
	case modeTx:
		tx, err := e.acquire(ctx, q)
		if err != nil {
			e.dbFailed(q, "acquire a connection", err)
			return false
		}
		q.tx = tx
	}
	cctx, span := e.startClaim(q)
	start := time.Now()
	var res responseClaim
	var err error
	wait := max(e.cfg.LockTimeout, time.Millisecond)
	switch {
	case q.mode == modeTx && e.onCitus(cctx, q.tx.conn):
		res, err = e.store.claimResponseRouted(cctx, q.tx, citusClaimPrelude(wait), q.claim)
	case q.mode == modeTx:
		res, q.stmts, err = e.store.claimTx(cctx, q.tx, q.claim, wait)
	default:
		res, err = e.lease(cctx, q, start)
	}
	e.metrics.op(q.claim.Consumer).lockWait.Observe(time.Since(start).Seconds())
	endClaim(span, res.ClaimResult, err)
	if err != nil {
		e.dbFailed(q, "claim", err)
		return false
	}
	e.noteExpired(q, res)
	if !res.Claimed {
		e.answerExisting(q, res)
		return false
	}
	q.row, q.fence = res.Row, res.Fence
	if q.mode == modeLease {
		tx, err := e.begin(ctx, q, true)
		if err != nil {
			e.releaseLease(q)
			e.dbFailed(q, "begin", err)
			return false
		}
		q.tx = tx
	}
	return true
}

// lease commits q's key as processing with a lease and a fence, or takes over one
// whose lease ran out (fence + 1). A key held by a fresh lease is polled until it
// settles, its lease runs out (then this request takes it over), or LockTimeout
// has passed since start.
func (e *engine) lease(ctx context.Context, q *request, start time.Time) (responseClaim, error) {
	res, err := e.store.LeaseResponse(ctx, e.cfg.Pool, q.claim, e.cfg.Lease.Duration)
	if err != nil || res.Claimed || res.Mismatch || res.Existing.State != inboxdb.StateProcessing {
		return res, err
	}
	if e.onLeaseWait != nil {
		e.onLeaseWait(q.r)
	}
	pause := 10 * time.Millisecond
	for {
		left := e.cfg.LockTimeout - time.Since(start)
		if left <= 0 {
			return responseClaim{ClaimResult: inboxdb.ClaimResult{Existing: &inboxdb.Record{State: inboxdb.StateProcessing}}}, nil
		}
		select {
		case <-q.r.Context().Done():
			return responseClaim{}, q.r.Context().Err()
		case <-time.After(min(pause, left)):
		}
		pause = min(2*pause, 200*time.Millisecond)
		res, err := e.store.LeaseResponse(q.r.Context(), e.cfg.Pool, q.claim, e.cfg.Lease.Duration)
		if err != nil || res.Claimed || res.Mismatch || res.Existing.State != inboxdb.StateProcessing {
			return res, err
		}
	}
}

func (e *engine) noteExpired(q *request, res responseClaim) {
	if res.ReplacedExpired {
		e.metrics.op(q.claim.Consumer).expired.Inc()
		e.log.Info("idem: key reused after its retention; running it as a new request", q.attrs()...)
	}
}

// begin begins a transaction on q's connection (acquired if q holds none), marked
// with txmark.Mark, in one round trip; withXID also takes the transaction's ID
// (lease mode, where rollBack needs it).
func (e *engine) begin(ctx context.Context, q *request, withXID bool) (*connTx, error) {
	tx, err := e.acquire(ctx, q)
	if err != nil {
		return nil, err
	}
	b := &pgx.Batch{}
	b.Queue(beginSQL)
	citus := e.onCitus(ctx, tx.conn)
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

// onCitus reports whether the schema is distributed by Citus (internal/citusmode),
// asking the database through conn (the request's connection, outside any
// transaction) on the first call; false while it cannot ask. On Citus every
// transaction sends citusmode.PropagateSet right after BEGIN, so that its SET
// LOCAL statements (lock_timeout, txmark.Mark) reach the workers, and the claim
// goes without the prepared statements, whose claim sets them with set_config,
// which Citus applies on the coordinator only.
func (e *engine) onCitus(ctx context.Context, conn *pgx.Conn) bool {
	if on, known := e.citus.Known(); known {
		return on
	}
	on, err := e.citus.On(ctx, conn, pgschema.Table(e.cfg.Schema, "inbox"))
	return err == nil && on
}

// citusClaimPrelude is the claim's prelude on Citus: BEGIN, then the settings as
// SET LOCAL statements that reach the workers.
func citusClaimPrelude(wait time.Duration) []string {
	return []string{beginSQL, citusmode.PropagateSet, lockTimeoutSQL(wait), txmark.Mark}
}
