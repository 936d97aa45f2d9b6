package consumer

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/tracing"
)

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
	citus, _ := c.citus.Known()
	bctx := effectsdb.WithScope(context.WithValue(sctx, txKey{}, r.owned),
		effectsdb.Scope{Schema: c.cfg.Schema, Kinds: c.cfg.EffectKinds, Citus: citus})
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
