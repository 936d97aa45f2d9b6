package consumer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel/attribute"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/inbox"
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
// error, so that one run more suffices. An error that names no message of msgs
// cannot be pinned on one: idem isolates the culprit by running the batch again
// with each message alone, each in its own savepoint. A batch handler may so run
// more than once for a message; only its database work counts, and it commits once.
type BatchHandler func(ctx context.Context, tx pgx.Tx, msgs []*message.Message) error

// MessageError names the message of a batch that an error belongs to. A
// BatchHandler returns one per failing message (see ForMessage). Its code and
// permanence are Err's.
type MessageError struct {
	Msg *message.Message
	Err error
}

// ForMessage says that err is msg's failure alone, for a BatchHandler to return
// (several joined with errors.Join). A nil err stays nil.
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

// maxSetRounds bounds the runs of one batch on the set-based path. Each run after
// the first leaves out the messages the one before failed; past the bound the
// batch falls back to one savepoint per message.
const maxSetRounds = 3

// setRun is one batch on the set-based path.
//
// One round: (1) one statement claims the keys of all the batch's messages (in the
// first round, in the same round trip as the SET LOCALs, the commit guard and the
// savepoint idem_batch; in later rounds, after ROLLBACK TO SAVEPOINT idem_batch);
// (2) the handlers run on the claimed messages without savepoints, their effects
// and output messages going to buffers; (3) one statement writes every buffered
// effect; (4) COMMIT. A failure that names its messages (a handler's error, a
// buffered effect's mismatch, a batch handler's ForMessage) decides those messages
// and starts another round without them; one that does not (a lock timeout in the
// claim, the transaction ended or aborted by a handler, a batch handler's error
// about no message in particular) falls back to runSavepoints for the whole batch.
type setRun struct {
	g      *groupCommitter
	c      *Consumer
	ctx    context.Context
	tx     pgx.Tx
	batch  []*groupReq // sorted by (consumer, tenant, key); copies in arrival order
	res    []outcome   // by batch index
	record []bool      // by batch index: failed permanently, recorded by the next claim
	// transient: by batch index, failed transiently (answered with res, never run
	// again for this delivery).
	transient []bool
	groups    []*keyGroup
	group     []*keyGroup // by batch index
	// claimed are the batch indexes whose keys this round claimed, to run.
	claimed []int
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
	rec *inbox.Record
}

type roundEnd int

const (
	roundDone     roundEnd = iota // committed (or answered); results are final
	roundAgain                    // some messages failed and are decided; run the rest again
	roundFallback                 // not pinned on a message: fall back to savepoints
)

// runSet runs a sorted batch on the set-based path. When the batch must go to
// runSavepoints instead, it returns the run, whose res, transient and record say
// what it decided already; nothing of the batch committed then.
func (g *groupCommitter) runSet(ctx context.Context, batch []*groupReq) ([]outcome, *setRun) {
	c := g.c
	r := &setRun{g: g, c: c, ctx: ctx, batch: batch,
		res: make([]outcome, len(batch)), record: make([]bool, len(batch)),
		transient: make([]bool, len(batch)), group: make([]*keyGroup, len(batch))}
	for i, gr := range batch {
		if i > 0 && batch[i-1].req.claim.ID == gr.req.claim.ID {
			grp := r.group[i-1]
			grp.copies = append(grp.copies, i)
			r.group[i] = grp
			continue
		}
		grp := &keyGroup{copies: []int{i}}
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
	r.tx = tx
	defer func() { _ = tx.Rollback(r.ctx) }()
	for round := range maxSetRounds {
		switch r.round(round) {
		case roundDone:
			return r.res, nil
		case roundFallback:
			return r.res, r
		}
	}
	return r.res, r
}

// round runs one round; see setRun.
func (r *setRun) round(n int) roundEnd {
	c := r.c
	claims := make([]inbox.BatchClaim, 0, len(r.groups))
	owners := make([]int, 0, len(r.groups))
	for _, grp := range r.groups {
		if grp.rec != nil || grp.rep >= len(grp.copies) {
			continue
		}
		i := grp.copies[grp.rep]
		bc := inbox.BatchClaim{Claim: r.batch[i].req.claim}
		if r.record[i] {
			bc.Failed, bc.Code, bc.Error = true, failureCode(r.res[i].err), truncate(r.res[i].err.Error())
		}
		claims = append(claims, bc)
		owners = append(owners, i)
	}
	prelude := []string{"ROLLBACK TO SAVEPOINT idem_batch"}
	if n == 0 {
		prelude = c.setPrelude
	}
	cctx, span := c.child(r.ctx, spanClaim)
	if span.IsRecording() {
		span.SetAttributes(tracing.BatchSize.Int(len(claims)), attribute.Int("idem.batch.round", n))
	}
	start := time.Now()
	results, err := c.store.ClaimBatchTx(cctx, r.tx, prelude, claims)
	endSpan(span, err)
	if err != nil {
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
	r.claimed = r.claimed[:0]
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

	var items []effects.Item
	var itemOwner []int
	if len(r.claimed) > 0 {
		var end roundEnd
		if r.g.batch != nil {
			items, itemOwner, end = r.runBatchHandler()
		} else {
			items, itemOwner, end = r.runHandlers()
		}
		if end != roundDone {
			return end
		}
	}
	if len(items) > 0 {
		if _, err := effects.EnqueueItems(r.ctx, r.tx, items); err != nil {
			var ie *effects.ItemErrors
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
				rec = r.ownRow(claim, inbox.StateCompleted, "", "")
			case outRecorded:
				rec = r.ownRow(claim, inbox.StateFailed, failureCode(o.err), truncate(o.err.Error()))
			}
		}
		for k := grp.rep + 1; k < len(grp.copies); k++ {
			i := grp.copies[k]
			if rec == nil {
				r.res[i] = outcome{kind: outBusy, err: fmt.Errorf("%w: an earlier copy of this key in the same batch did not complete", ErrBusy)}
				continue
			}
			fp := r.batch[i].req.claim.Fingerprint
			r.res[i] = existingOutcome(inbox.ClaimResult{Existing: rec, Mismatch: !bytes.Equal(rec.Fingerprint, fp)})
		}
	}
}

// ownRow is the row this batch wrote for claim, as a later copy of its key meets it.
func (r *setRun) ownRow(claim inbox.Claim, state inbox.State, code, msg string) *inbox.Record {
	now := time.Now()
	return &inbox.Record{Consumer: claim.Consumer, Tenant: claim.Tenant, Key: claim.Key,
		Fingerprint: claim.Fingerprint, State: state, ErrorCode: code, Error: msg,
		Attempts: 1, ReceivedAt: now, CompletedAt: &now, Now: now}
}

// fail decides a claimed message's outcome after its handler (or its effects)
// failed: a permanent failure is recorded by the next round's claim; after a
// transient one the next copy of its key, if any, claims the key.
func (r *setRun) fail(i int, o outcome) {
	r.res[i] = o
	if o.kind == outPermanent {
		r.record[i] = true
		return
	}
	r.transient[i] = true
	r.group[i].rep++
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
func (r *setRun) runHandlers() ([]effects.Item, []int, roundEnd) {
	var items []effects.Item
	var owners []int
	for _, i := range r.claimed {
		gr := r.batch[i]
		buf := effects.NewBuffer()
		o := r.guarded(func() outcome { return r.c.runHandlerBuffered(gr.req, r.tx, gr.h, buf) })
		got := buf.Close()
		if errors.Is(o.err, ErrTxEnded) {
			// Nothing more may go into a transaction the handler ended; the commit
			// guard made a COMMIT of its fail, so nothing of the batch committed. The
			// rest of the batch goes on in a new transaction.
			r.fail(i, o)
			return nil, nil, roundFallback
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

// runBatchHandler runs the batch handler once on every claimed message.
func (r *setRun) runBatchHandler() ([]effects.Item, []int, roundEnd) {
	c := r.c
	msgs := make([]*message.Message, len(r.claimed))
	bufs := make([]*effects.Buffer, len(r.claimed))
	for j, i := range r.claimed {
		req := r.batch[i].req
		bufs[j] = effects.NewBuffer()
		req.msg.SetContext(c.handlerContext(req.ctx, r.tx, c.scope(req, bufs[j])))
		msgs[j] = req.msg
	}
	sctx, span := c.child(r.ctx, spanHandler)
	if span.IsRecording() {
		span.SetAttributes(tracing.BatchSize.Int(len(msgs)))
	}
	bctx := effects.WithScope(context.WithValue(sctx, txKey{}, ownedTx{r.tx}),
		effects.Scope{Schema: c.cfg.Schema, Kinds: c.cfg.EffectKinds})
	var err error
	var panicked bool
	func() {
		defer func() {
			for _, i := range r.claimed {
				req := r.batch[i].req
				req.msg.SetContext(req.msgCtx) // the messages are not ours
			}
			if p := recover(); p != nil {
				panicked = true
				err = fmt.Errorf("batch handler panicked: %v", p)
			}
		}()
		err = r.g.batch(bctx, ownedTx{r.tx}, msgs)
	}()
	endSpan(span, err)
	for _, b := range bufs {
		b.Close()
	}
	state := txState(r.tx)
	if errors.Is(state, ErrTxEnded) || (err == nil && state != nil) || panicked {
		return nil, nil, roundFallback
	}
	if err != nil {
		index := make(map[*message.Message]int, len(r.claimed))
		for _, i := range r.claimed {
			index[r.batch[i].req.msg] = i
		}
		named := map[int]error{}
		for _, me := range messageErrors(err) {
			if i, ok := index[me.Msg]; ok {
				if _, twice := named[i]; !twice {
					named[i] = me.Err
				}
			}
		}
		for i, e := range named {
			r.fail(i, outcomeOf(e))
		}
		if len(named) == 0 {
			return nil, nil, roundFallback
		}
		return nil, nil, roundAgain
	}
	var items []effects.Item
	var owners []int
	for j, i := range r.claimed {
		for _, it := range bufs[j].Close() {
			items = append(items, it)
			owners = append(owners, i)
		}
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

// messageErrors returns the MessageErrors in err's tree, without looking inside them.
func messageErrors(err error) []*MessageError {
	var out []*MessageError
	var walk func(error)
	walk = func(err error) {
		switch e := err.(type) {
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
