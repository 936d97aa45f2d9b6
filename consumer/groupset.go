package consumer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel/attribute"

	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/tracing"
)

// maxSetRounds bounds the full runs of one batch on the set-based path: runs of
// every claimed message's handler, or of the batch handler on all of them. Each run
// after the first leaves out the messages the one before failed; past the bound the
// batch falls back to one savepoint per message. The rounds that isolate a batch
// handler's poison message by bisection (isolate) do not count: each one decides a
// message or commits.
const maxSetRounds = 3

// maxSavepoints bounds the SAVEPOINTs idem sends in one transaction: half of the
// 64 subtransactions a Postgres backend caches (PGPROC_MAX_CACHED_SUBXIDS), leaving
// the rest to handlers' own. Past 64 the cache overflows, and every snapshot taken
// while the transaction runs must then look its subtransactions up in pg_subtrans.
const maxSavepoints = 32

// setRun is one batch on the set-based path.
//
// One round: (1) one statement claims the keys of all the batch's messages (in the
// first round, in the same round trip as the SET LOCALs, the commit guard and the
// savepoint idem_batch; in later rounds, after ROLLBACK TO SAVEPOINT idem_batch);
// (2) the handlers run on the claimed messages without savepoints, their effects
// and output messages going to buffers; (3) one statement writes every buffered
// effect; (4) COMMIT. A failure that names its messages (a handler's error, a
// buffered effect's mismatch, a batch handler's ForMessage) decides those messages
// and starts another round without them. A batch handler's error that names none of
// its messages (or its panic) makes the next round isolate the culprits by
// bisection (isolate). A handler that ends the transaction is decided (outEnded)
// and the rest go on in a fresh set run. Other failures that cannot be pinned on a
// message (a lock timeout in the claim, a transaction a message handler replaced
// unseen) fall back to runSavepoints for the whole batch.
type setRun struct {
	g      *groupCommitter
	c      *engine
	ctx    context.Context
	tx     pgx.Tx
	owned  pgx.Tx      // tx as handlers see it (ownedTx), boxed once
	batch  []*groupReq // sorted by (consumer, tenant, key); copies in arrival order
	res    []outcome   // by batch index
	record []bool      // by batch index: failed permanently, recorded by the next claim
	// done: by batch index, answered with res and never run again for this
	// delivery: a transient failure, a batch handler's error naming a message
	// outside its call, or a handler that ended idem's transaction (outEnded,
	// recorded once the run is over).
	done   []bool
	groups []*keyGroup
	group  []*keyGroup // by batch index
	// claimed are the batch indexes whose keys this round claimed, to run.
	claimed []int
	// decided: this run decided some message's failure.
	decided bool
	// suspect: the batch handler failed on the claimed messages with an error that
	// names none of them; the next round isolates the culprits.
	suspect bool
	// renew: the run ends uncommitted with its transaction spent (a handler ended
	// it, or isolate used up maxSavepoints) after deciding some messages; the
	// undecided ones go on in a fresh set run (at once isolating, if suspect).
	renew bool
	// savepoints counts the SAVEPOINTs idem sent in tx.
	savepoints int
	// lastCall is the batch indexes of the batch handler's last call.
	lastCall []int
}

// keyGroup is the copies of one key in a batch. One of them, the representative,
// claims the key; the others are answered from what that claim found, as they
// would be had they come after it: a duplicate, a replay, or a mismatch.
type keyGroup struct {
	copies []int // batch indexes, in arrival order
	// rep is the position in copies of the copy that claims the key next (or
	// claimed it). A copy that fails transiently hands the key to the next one.
	rep int
	// rec is the row the claim found committed already; then the key is settled
	// for the whole batch and is not claimed again in later rounds.
	rec *inboxdb.Record
}

type roundEnd int

const (
	roundDone     roundEnd = iota // committed (or answered); results are final
	roundAgain                    // some messages failed and are decided; run the rest again
	roundFallback                 // not pinned on a message: fall back to savepoints
	roundRenew                    // tx spent, messages decided: a fresh set run for the rest
)

// runSet runs a sorted batch on the set-based path. prior, if not nil, holds by
// batch index the permanent failures an earlier run decided: this run's first claim
// records them, and their handlers do not run. suspect says that the batch handler
// fails on these messages with an error that names none of them: the first round
// isolates at once. When the batch must go on elsewhere, runSet returns the run,
// whose res, done and record say what it decided, and renew whether a fresh set
// run takes the rest (otherwise runSavepoints does); nothing of the batch committed
// then.
func (g *groupCommitter) runSet(ctx context.Context, batch []*groupReq, prior []outcome, suspect bool) ([]outcome, *setRun) {
	c := g.c
	r := &setRun{g: g, c: c, ctx: ctx, batch: batch, suspect: suspect,
		res: make([]outcome, len(batch)), record: make([]bool, len(batch)),
		done: make([]bool, len(batch)), group: make([]*keyGroup, len(batch))}
	for i, p := range prior {
		if p.kind == outPermanent {
			r.res[i], r.record[i] = p, true
		}
	}
	// The batch is sorted, so the copies of a key are next to each other: each
	// group's copies are a slice of one array of batch indexes, and the groups
	// come from one array too.
	seq := make([]int, len(batch))
	slab := make([]keyGroup, 0, len(batch))
	for i, gr := range batch {
		seq[i] = i
		if i > 0 && batch[i-1].req.claim.ID == gr.req.claim.ID {
			grp := r.group[i-1]
			grp.copies = seq[grp.copies[0] : i+1 : i+1]
			r.group[i] = grp
			continue
		}
		slab = append(slab, keyGroup{copies: seq[i : i+1 : i+1]})
		grp := &slab[len(slab)-1]
		r.groups = append(r.groups, grp)
		r.group[i] = grp
	}
	tx, err := c.beginGroup(r.ctx)
	if err != nil {
		for i := range r.res {
			r.res[i] = outcome{kind: outTransient, err: fmt.Errorf("begin: %w", err)}
		}
		return r.res, nil
	}
	r.tx, r.owned = tx, ownedTx{tx}
	defer func() { _ = tx.Rollback(r.ctx) }()
	for n, full := 0, 0; full < maxSetRounds; n++ {
		isolating := r.suspect
		switch end := r.round(n); end {
		case roundDone:
			return r.res, nil
		case roundFallback, roundRenew:
			// A fresh run only after progress; otherwise the savepoint path.
			r.renew = end == roundRenew && r.decided
			return r.res, r
		}
		if !isolating {
			full++
		}
	}
	return r.res, r
}

// round runs one round; see setRun.
func (r *setRun) round(n int) roundEnd {
	c := r.c
	claims := make([]batchClaim, 0, len(r.groups))
	owners := make([]int, 0, len(r.groups))
	for _, grp := range r.groups {
		if grp.rec != nil || grp.rep >= len(grp.copies) {
			continue
		}
		i := grp.copies[grp.rep]
		bc := batchClaim{Claim: r.batch[i].req.claim}
		if r.record[i] {
			bc.Failed, bc.Code, bc.Error = true, failureCode(r.res[i].err), truncate(r.res[i].err.Error())
		}
		claims = append(claims, bc)
		owners = append(owners, i)
	}
	prelude := []string{"ROLLBACK TO SAVEPOINT idem_batch"}
	if n == 0 {
		prelude = c.setPrelude
		r.savepoints++ // idem_batch
	}
	cctx, span := c.child(r.ctx, spanClaim)
	if span.IsRecording() {
		span.SetAttributes(tracing.BatchSize.Int(len(claims)), attribute.Int("idem.batch.round", n))
	}
	start := time.Now()
	results, err := c.batchStore.ClaimBatchTx(cctx, r.tx, prelude, claims, r.g.onCitus())
	endSpan(span, err)
	if err != nil {
		if n > 0 && savepointGone(err) && r.lastCall != nil {
			// ROLLBACK TO SAVEPOINT idem_batch found no idem_batch: the batch
			// handler's last call ended idem's transaction and began another.
			r.endCall(r.lastCall, errTxReplaced)
			return roundRenew
		}
		if n > 0 || lockConflict(err) {
			// Which key waited too long (or deadlocked) is unknown: isolate it.
			return roundFallback
		}
		o := classify(err)
		if o.kind == outPermanent {
			o.kind = outTransient // nothing about the messages themselves
		}
		o.claimFailed = true
		for i := range r.res {
			r.res[i] = o
		}
		return roundDone
	}
	if n == 0 {
		wait := time.Since(start).Seconds()
		for _, i := range owners {
			c.metrics.lockWait.WithLabelValues(r.batch[i].req.claim.Consumer).Observe(wait)
		}
	}
	r.claimed = nil // a fresh slice: lastCall may hold the last round's
	for j, res := range results {
		i := owners[j]
		c.noteExpired(r.batch[i].req, res)
		switch {
		case r.record[i] && res.Claimed:
			r.res[i] = outcome{kind: outRecorded, err: r.res[i].err}
		case res.Claimed:
			r.claimed = append(r.claimed, i)
		default:
			r.res[i] = existingOutcome(res)
			r.group[i].rec = res.Existing
		}
	}

	var items []effectsdb.Item
	var itemOwner []int
	if len(r.claimed) > 0 {
		var end roundEnd
		switch {
		case r.g.batch == nil:
			items, itemOwner, end = r.runHandlers()
		case r.suspect:
			items, itemOwner, end = r.isolate()
		default:
			items, itemOwner, end = r.runBatchHandler()
		}
		if end != roundDone {
			return end
		}
	}
	if len(items) > 0 {
		if _, err := effectsdb.EnqueueItems(r.ctx, r.tx, items); err != nil {
			var ie *effectsdb.ItemErrors
			if !errors.As(err, &ie) {
				return roundFallback
			}
			for j, e := range ie.Errs {
				if e != nil {
					r.fail(itemOwner[j], outcomeOf(e))
				}
			}
			return roundAgain
		}
	}
	_, span = c.child(r.ctx, spanCommit)
	err = c.commit(r.ctx, r.tx)
	endSpan(span, err)
	if err != nil {
		if errors.Is(err, ErrTxEnded) && r.lastCall != nil {
			// The mark is gone: the batch handler's last call began a transaction
			// in place of idem's (an earlier call would have failed the next
			// round's ROLLBACK TO SAVEPOINT, and a part of isolate its RELEASE).
			r.endCall(r.lastCall, err)
			return roundRenew
		}
		if errors.Is(err, ErrTxEnded) || errors.Is(err, ErrTxAborted) {
			return roundFallback // a handler replaced or broke the transaction unseen
		}
		r.committed()
		commitFailed(r.res, err)
		return roundDone
	}
	r.committed()
	return roundDone
}

// committed settles the claimed messages and the copies that follow each key's
// representative.
func (r *setRun) committed() {
	for _, i := range r.claimed {
		r.res[i] = outcome{kind: outCommitted}
	}
	for _, grp := range r.groups {
		if len(grp.copies) == 1 {
			continue
		}
		rec := grp.rec
		if rec == nil && grp.rep < len(grp.copies) {
			owner := grp.copies[grp.rep]
			claim := r.batch[owner].req.claim
			switch o := r.res[owner]; o.kind {
			case outCommitted:
				rec = r.ownRow(claim, inboxdb.StateCompleted, "", "")
			case outRecorded:
				rec = r.ownRow(claim, inboxdb.StateFailed, failureCode(o.err), truncate(o.err.Error()))
			}
		}
		for k := grp.rep + 1; k < len(grp.copies); k++ {
			i := grp.copies[k]
			if rec == nil {
				r.res[i] = outcome{kind: outBusy, err: fmt.Errorf("%w: an earlier copy of this key in the same batch did not complete", ErrBusy)}
				continue
			}
			fp := r.batch[i].req.claim.Fingerprint
			r.res[i] = existingOutcome(inboxdb.ClaimResult{Existing: rec, Mismatch: !bytes.Equal(rec.Fingerprint, fp)})
		}
	}
}

// ownRow is the row this batch wrote for claim, as a later copy of its key meets it.
func (r *setRun) ownRow(claim inboxdb.Claim, state inboxdb.State, code, msg string) *inboxdb.Record {
	now := time.Now()
	return &inboxdb.Record{Consumer: claim.Consumer, Tenant: claim.Tenant, Key: claim.Key,
		Fingerprint: claim.Fingerprint, State: state, ErrorCode: code, Error: msg,
		Attempts: 1, ReceivedAt: now, CompletedAt: &now, Now: now}
}

// fail decides a claimed message's outcome after its handler (or its effects)
// failed: a permanent failure is recorded by the next round's claim; after any
// other the message is done, and the next copy of its key, if any, claims the key.
func (r *setRun) fail(i int, o outcome) {
	r.res[i] = o
	r.decided = true
	if o.kind == outPermanent {
		r.record[i] = true
		return
	}
	if !r.done[i] {
		r.done[i], r.record[i] = true, false
		r.group[i].rep++
	}
}

// endCall decides every message of a batch handler call that ended idem's
// transaction: what the handler ran after that committed on its own, for any of
// them, so none may run again.
func (r *setRun) endCall(idx []int, cause error) {
	for _, i := range idx {
		r.fail(i, outcome{kind: outEnded, err: cause})
	}
}

// outcomeOf classifies an error pinned on one message.
func outcomeOf(err error) outcome {
	if err == nil {
		err = errors.New("idem: a batch handler named a message without an error")
	}
	return classify(err)
}

// lockConflict reports whether err is a wait on another transaction's keys that
// ended badly: a lock timeout, a deadlock, or a serialization failure.
func lockConflict(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	switch pgErr.Code {
	case pgerrcode.LockNotAvailable, pgerrcode.DeadlockDetected, pgerrcode.SerializationFailure:
		return true
	}
	return false
}
