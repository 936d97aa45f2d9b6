package consumer

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel/attribute"

	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/tracing"
)

// BatchHandler handles the messages of a batch together, in one transaction, for
// set-based business writes (one INSERT … SELECT FROM unnest(…) for the batch). msgs
// are the messages whose keys the batch claimed, in (tenant, key) order: duplicates,
// recorded failures, mismatches and invalid messages never reach it.
//
// tx is the batch's transaction; as in a message handler, idem owns it (return nil
// to commit, an error to roll back; never end it yourself). ctx carries tx too
// (Tx(ctx)). Each message's own context (msg.Context()) carries the message's
// effects scope: effects.Enqueue(msg.Context(), tx, …) and effects.EnqueueMany add
// the message's effects, with its tenant and source, to the batch's one set-based
// write at the end. effects.Enqueue with ctx itself writes at once, with no tenant
// and no source, as from a plain transaction.
//
// Return nil when every message succeeded. To fail some messages, return an error
// that names them: ForMessage(msg, err) for each, joined with errors.Join. idem then
// rolls the batch back, answers each named message with its own error (a permanent
// one, consumer.Permanent, is recorded as that message's failure alone), and runs
// the batch handler again with the others. Name every failing message in one
// error, so that one run more suffices. An error that names no message (or a
// panic) cannot be pinned on one: idem isolates the culprits by bisection, running
// the handler on halves of msgs, each in a savepoint of its own, and halving the
// ones that fail until single messages fail alone (about 2·log2(n) runs for one
// poison message among n). An error that names a message that is not in msgs is a
// bug: every message of that call is nacked with ErrMessageNotInBatch, and none is
// recorded. A batch handler may so run more than once for a message; only its
// database work counts, and it commits once. A batch handler that ends the
// transaction has every message of that call recorded as failed (ErrTxEnded).
type BatchHandler func(ctx context.Context, tx pgx.Tx, msgs []*message.Message) error

// MessageError names the message of a batch that an error belongs to. A
// BatchHandler returns one per failing message (see ForMessage). Its code and
// permanence are Err's.
type MessageError struct {
	Msg *message.Message
	Err error
}

// ForMessage says that err is msg's failure alone, for a BatchHandler to return
// (several joined with errors.Join). msg must be one of the messages of the call
// that returns it (else ErrMessageNotInBatch). A nil err stays nil.
func ForMessage(msg *message.Message, err error) error {
	if err == nil {
		return nil
	}
	return &MessageError{Msg: msg, Err: err}
}

func (e *MessageError) Error() string {
	id := "<nil>"
	if e.Msg != nil {
		id = e.Msg.UUID
	}
	return fmt.Sprintf("message %s: %v", id, e.Err)
}

// Unwrap returns the message's own error.
func (e *MessageError) Unwrap() error { return e.Err }

// HandleBatch returns a Watermill handler that runs h on batches. Watermill hands a
// handler one message per call: each call joins a batch (the messages that arrive
// together, up to MaxBatch, waiting at most MaxWait for more; Workers batches run at
// once, whatever Mode says) and returns when its batch has committed, with the
// message's own answer. Put it in a router with AddConsumerHandler; Retry and
// PoisonQueue go outside it with AddMiddleware, as for the Middleware. A batch needs
// many messages in flight: many partitions, or a subscriber that delivers several
// messages of one partition at once.
//
// HandleBatch panics in Lease mode, which holds one message's key outside any
// transaction and has no batches.
func (c *Consumer) HandleBatch(h BatchHandler) message.NoPublishHandlerFunc {
	if h == nil {
		panic("idem: HandleBatch needs a BatchHandler")
	}
	if c.cfg.Mode == Lease {
		panic("idem: HandleBatch needs Transactional or GroupCommit mode; Lease mode has no batches")
	}
	if c.shards != nil {
		return c.shards.handleBatch(h)
	}
	var slot *groupCommitter
	return func(msg *message.Message) error {
		req, err := c.prepare(msg)
		if err != nil {
			return err
		}
		defer endPanicked(req)
		g, ok := c.enterBatch(&slot, h)
		if !ok {
			return c.finish(req, outcome{kind: outTransient, err: ErrClosed})
		}
		defer c.inflight.Done()
		if req.invalid != nil {
			return c.finish(req, c.recordFailure(req, req.invalid))
		}
		return g.submit(req, nil)
	}
}

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
	c      *Consumer
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
	results, err := c.batchStore.ClaimBatchTx(cctx, r.tx, prelude, claims)
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

// runHandlers runs each claimed message's own handler in turn, with no savepoint,
// and stops at the first failure.
func (r *setRun) runHandlers() ([]effectsdb.Item, []int, roundEnd) {
	var items []effectsdb.Item
	var owners []int
	bufs := make([]effectsdb.Buffer, len(r.claimed)) // one allocation for the round's buffers
	for j, i := range r.claimed {
		gr := r.batch[i]
		buf := &bufs[j]
		o := r.guarded(func() outcome { return r.c.runHandlerBuffered(gr.req, r.tx, r.owned, gr.h, buf) })
		got := buf.Close()
		if o.kind == outEnded {
			// Nothing more may go into a transaction the handler ended; the commit
			// guard made a COMMIT of its fail, so nothing of the batch committed. The
			// rest of the batch goes on in a fresh set run.
			r.fail(i, o)
			return nil, nil, roundRenew
		}
		if o.kind != outCommitted {
			r.fail(i, o)
			return nil, nil, roundAgain
		}
		for _, it := range got {
			items = append(items, it)
			owners = append(owners, i)
		}
	}
	return items, owners, roundDone
}

// callResult is what one call of the batch handler left: its buffered effects (and
// the batch index of each one's message) if it succeeded, its error (a panic's,
// recovered), and the transaction's state after it (txState).
type callResult struct {
	items  []effectsdb.Item
	owners []int
	err    error
	state  error
}

// cause is the call's failure: its error, or the transaction's state.
func (cr callResult) cause() error { return cmp.Or(cr.err, cr.state) }

// call runs the batch handler once on the messages idx (batch indexes, claimed).
func (r *setRun) call(idx []int) callResult {
	c := r.c
	r.lastCall = idx
	msgs := make([]*message.Message, len(idx))
	bufs := make([]effectsdb.Buffer, len(idx)) // one allocation for the call's buffers
	for j, i := range idx {
		req := r.batch[i].req
		req.msg.SetContext(c.handlerContext(req.ctx, r.owned, c.scope(req, &bufs[j])))
		msgs[j] = req.msg
	}
	sctx, span := c.child(r.ctx, spanHandler)
	if span.IsRecording() {
		span.SetAttributes(tracing.BatchSize.Int(len(msgs)))
	}
	bctx := effectsdb.WithScope(context.WithValue(sctx, txKey{}, r.owned),
		effectsdb.Scope{Schema: c.cfg.Schema, Kinds: c.cfg.EffectKinds})
	var cr callResult
	func() {
		defer func() {
			for _, i := range idx {
				req := r.batch[i].req
				req.msg.SetContext(req.msgCtx) // the messages are not ours
			}
			if p := recover(); p != nil {
				cr.err = fmt.Errorf("batch handler panicked: %v", p)
			}
		}()
		cr.err = r.g.batch(bctx, r.owned, msgs)
	}()
	endSpan(span, cr.err)
	cr.state = txState(r.tx)
	for j, i := range idx {
		got := bufs[j].Close()
		if cr.err == nil && cr.state == nil {
			for _, it := range got {
				cr.items = append(cr.items, it)
				cr.owners = append(cr.owners, i)
			}
		}
	}
	return cr
}

// verdict is what one batch handler call says about its messages.
type verdict int

const (
	callOK      verdict = iota // all succeeded: keep the work
	callDecided                // it named its failing messages, now decided
	callUnnamed                // it failed (or panicked) naming none of its messages
	callEnded                  // it ended idem's transaction: all its messages decided
)

// judge decides what cr, the result of the call on idx, says. A call that ended
// the transaction decides all of idx (endCall). One whose error names a message
// outside idx is a bug in the handler: all of idx are nacked with
// ErrMessageNotInBatch, and none is recorded.
func (r *setRun) judge(idx []int, cr callResult) verdict {
	if errors.Is(cr.state, ErrTxEnded) {
		cause := cr.state
		if cr.err != nil {
			cause = fmt.Errorf("%w (the handler returned: %v)", cr.state, cr.err)
		}
		r.endCall(idx, cause)
		return callEnded
	}
	if cr.err == nil && cr.state == nil {
		return callOK
	}
	index := make(map[*message.Message]int, len(idx))
	for _, i := range idx {
		index[r.batch[i].req.msg] = i
	}
	named, foreign := pinned(cr.err, index)
	if foreign != nil {
		for _, i := range idx {
			r.fail(i, outcome{kind: outTransient, err: foreign})
		}
		return callDecided
	}
	if len(named) == 0 {
		return callUnnamed
	}
	for i, e := range named {
		r.fail(i, outcomeOf(e))
	}
	return callDecided
}

// runBatchHandler runs the batch handler once on every claimed message.
func (r *setRun) runBatchHandler() ([]effectsdb.Item, []int, roundEnd) {
	cr := r.call(r.claimed)
	switch r.judge(r.claimed, cr) {
	case callOK:
		return cr.items, cr.owners, roundDone
	case callEnded:
		return nil, nil, roundRenew
	case callUnnamed:
		r.suspect = true
	}
	return nil, nil, roundAgain
}

// isolate runs the batch handler by bisection on the claimed messages, on which it
// failed with an error that names none of them (or panicked): each half in a
// savepoint of its own; a half that succeeds is kept, one that fails is halved
// again, down to the single messages that fail alone, each decided with its own
// error. An error that names messages decides them, and the rest of its half runs
// again. One poison message among n costs about 2·log2(n) calls, and as many
// savepoints, all in one transaction.
//
// If it decided messages, the next round runs the handler on the rest (their claims
// redone, the decided ones left out or recorded). If every half succeeded (the
// messages fail only all together), the halves' work is what the round commits.
// When tx has had maxSavepoints savepoints it stops, and the undecided messages go
// on in a fresh run, which isolates at once.
func (r *setRun) isolate() ([]effectsdb.Item, []int, roundEnd) {
	r.suspect = false
	var items []effectsdb.Item
	var owners []int
	found := false
	var test func(part []int) roundEnd
	split := func(part []int) roundEnd {
		half := len(part) / 2
		if end := test(part[:half]); end != roundDone {
			return end
		}
		return test(part[half:])
	}
	test = func(part []int) roundEnd {
		if len(part) == 0 {
			return roundDone
		}
		if r.savepoints >= maxSavepoints {
			r.suspect = true
			return roundRenew
		}
		sp := "idem_part_" + strconv.Itoa(r.savepoints)
		if _, err := r.tx.Exec(r.ctx, "SAVEPOINT "+sp); err != nil {
			return roundFallback
		}
		r.savepoints++
		cr := r.call(part)
		v := r.judge(part, cr)
		if v == callEnded {
			return roundRenew
		}
		end := "RELEASE SAVEPOINT " + sp
		if v != callOK {
			end = "ROLLBACK TO SAVEPOINT " + sp + "; " + end
		}
		if _, err := r.tx.Exec(r.ctx, end); err != nil {
			if savepointGone(err) {
				// The call ended idem's transaction and began another.
				r.endCall(part, errTxReplaced)
				return roundRenew
			}
			return roundFallback
		}
		switch {
		case v == callOK:
			items = append(items, cr.items...)
			owners = append(owners, cr.owners...)
			return roundDone
		case v == callDecided:
			found = true
			return test(slices.DeleteFunc(slices.Clone(part), func(i int) bool { return r.done[i] || r.record[i] }))
		case len(part) == 1:
			r.fail(part[0], outcomeOf(cr.cause()))
			found = true
			return roundDone
		}
		return split(part)
	}
	if end := split(r.claimed); end != roundDone {
		return nil, nil, end
	}
	if found {
		return nil, nil, roundAgain
	}
	return items, owners, roundDone
}

// guarded runs fn, turning a panic into a transient failure of that message (the
// worker goroutine must survive it).
func (r *setRun) guarded(fn func() outcome) (o outcome) {
	defer func() {
		if p := recover(); p != nil {
			o = outcome{kind: outTransient, err: fmt.Errorf("handler panicked: %v", p)}
		}
	}()
	return fn()
}

// pinned maps the MessageErrors in err to the batch indexes of the messages they
// name (index). One that names a message outside index makes foreign
// ErrMessageNotInBatch, with err's text but not its chain: a permanent error about
// a message that is not there must not record the innocent ones as failed.
func pinned(err error, index map[*message.Message]int) (named map[int]error, foreign error) {
	named = map[int]error{}
	for _, me := range messageErrors(err) {
		i, ok := index[me.Msg]
		if !ok {
			return nil, fmt.Errorf("%w: %v", ErrMessageNotInBatch, err)
		}
		if _, twice := named[i]; !twice {
			named[i] = cmp.Or(me.Err, errors.New("idem: a batch handler named a message without an error"))
		}
	}
	return named, nil
}

// messageErrors returns the MessageErrors in err's tree, without looking inside them.
func messageErrors(err error) []*MessageError {
	var out []*MessageError
	var walk func(error)
	walk = func(err error) {
		switch e := err.(type) { //nolint:errorlint // it walks the tree itself, to stop at each MessageError
		case nil:
		case *MessageError:
			out = append(out, e)
		case interface{ Unwrap() []error }:
			for _, inner := range e.Unwrap() {
				walk(inner)
			}
		case interface{ Unwrap() error }:
			walk(e.Unwrap())
		}
	}
	walk(err)
	return out
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
