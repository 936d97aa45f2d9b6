package consumer

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
)

// groupCommitter runs batches: workers take the messages that arrive together (up to
// Batch.MaxBatch, waiting at most Batch.MaxWait for more) and run them in one transaction, then
// answer them all after the commit. Middleware in GroupCommit mode has one, with
// each message's own handler; each HandleBatch has one, with its batch handler.
// A batch runs on the set-based path (batch.go) and falls back to one savepoint per
// message (runSavepoints) when a failure cannot be pinned on a message there.
type groupCommitter struct {
	c     *engine
	batch BatchHandler // nil: each request carries its own handler
	// single is g.single as a handler, made once (a method value costs an
	// allocation each time it is taken).
	single message.HandlerFunc
	reqs   chan *groupReq
	stop   chan struct{}
	wg     sync.WaitGroup
	close  func()
	// free holds groupReqs, with their done channels, to reuse.
	free sync.Pool
}

type groupReq struct {
	req  *request
	h    message.HandlerFunc
	done chan outcome
}

func newGroupCommitter(c *engine, batch BatchHandler) *groupCommitter {
	g := &groupCommitter{c: c, batch: batch, reqs: make(chan *groupReq), stop: make(chan struct{})}
	g.single = g.runSingle
	g.close = sync.OnceFunc(func() {
		close(g.stop)
		g.wg.Wait()
	})
	for range c.cfg.Batch.Workers {
		g.wg.Add(1)
		go g.work()
	}
	return g
}

// submit hands one message to a batch and waits for its outcome. h is the message's
// handler; with a batch handler it is nil.
func (g *groupCommitter) submit(req *request, h message.HandlerFunc) outcome {
	// One message's cancelled context must not cancel a statement of the shared
	// transaction: pgx closes the connection on cancel, which would fail the batch.
	req.ctx = context.WithoutCancel(req.ctx)
	if h == nil {
		h = g.single
	}
	gr, _ := g.free.Get().(*groupReq)
	if gr == nil {
		gr = &groupReq{done: make(chan outcome, 1)}
	}
	gr.req, gr.h = req, h
	select {
	case g.reqs <- gr:
	case <-g.stop:
		return outcome{kind: outTransient, err: ErrClosed}
	}
	o := <-gr.done
	// The batch sends one outcome and keeps nothing of gr after it.
	*gr = groupReq{done: gr.done}
	g.free.Put(gr)
	return o
}

// runSingle runs the batch handler on one message, as a message handler: the
// savepoint path's way of running a batch handler. An error that names msg is
// msg's own; one that names another message is ErrMessageNotInBatch.
func (g *groupCommitter) runSingle(msg *message.Message) ([]*message.Message, error) {
	ctx := msg.Context()
	err := g.batch(ctx, Tx(ctx), []*message.Message{msg})
	named, foreign := pinned(err, map[*message.Message]int{msg: 0})
	switch {
	case foreign != nil:
		return nil, foreign
	case named[0] != nil:
		return nil, named[0]
	}
	return nil, err
}

func (g *groupCommitter) work() {
	defer g.wg.Done()
	for {
		var batch []*groupReq
		select {
		case r := <-g.reqs:
			batch = append(batch, r)
		case <-g.stop:
			return
		}
		timer := time.NewTimer(g.c.cfg.Batch.MaxWait)
	collect:
		for len(batch) < g.c.cfg.Batch.MaxBatch {
			select {
			case r := <-g.reqs:
				batch = append(batch, r)
			case <-timer.C:
				break collect
			case <-g.stop:
				break collect
			}
		}
		timer.Stop()
		// On Citus a batch's statements must each name one tenant, so every batch
		// is split by tenant, whatever Batch.PerTenant says.
		if g.c.cfg.Batch.PerTenant || g.onCitus() {
			g.runPerTenant(batch)
			continue
		}
		g.run(batch)
	}
}

// onCitus is engine.onCitus, bounded by CommitTimeout; once the answer is known
// it costs no context.
func (g *groupCommitter) onCitus() bool {
	if on, known := g.c.citus.Known(); known {
		return on
	}
	ctx, cancel := context.WithTimeout(context.Background(), g.c.cfg.CommitTimeout)
	defer cancel()
	return g.c.onCitus(ctx)
}

// runPerTenant runs batch as one batch per tenant, one after another
// (Config.Batch.PerTenant).
func (g *groupCommitter) runPerTenant(batch []*groupReq) {
	slices.SortStableFunc(batch, func(a, b *groupReq) int { return cmp.Compare(a.req.claim.Tenant, b.req.claim.Tenant) })
	for len(batch) > 0 {
		n := 1
		for n < len(batch) && batch[n].req.claim.Tenant == batch[0].req.claim.Tenant {
			n++
		}
		g.run(batch[:n:n])
		batch = batch[n:]
	}
}

// run handles one batch and answers each of its messages. Keys are claimed in sorted
// order, so two batches that share keys take their row locks in the same order and
// cannot deadlock; copies of one key keep their arrival order.
//
// The batch runs on the set-based path (runSet). A set run that can go no further in
// its transaction, but decided some messages (a handler ended the transaction; the
// isolation of a poison message ran out of savepoints), hands the undecided ones to
// a fresh set run; one that cannot pin a failure on a message hands them to the
// savepoint path (runSavepoints). Between two runs, with no connection held, the
// keys whose handlers ended idem's transaction are recorded as failed (recordEnded).
func (g *groupCommitter) run(batch []*groupReq) {
	slices.SortStableFunc(batch, func(a, b *groupReq) int {
		x, y := &a.req.claim, &b.req.claim
		return cmp.Or(cmp.Compare(x.Consumer, y.Consumer), cmp.Compare(x.Tenant, y.Tenant), cmp.Compare(x.Key, y.Key))
	})
	ctx, span := g.c.startBatch(batch)
	results := make([]outcome, len(batch))
	rest := batch
	at := make([]int, len(batch)) // at[j] is rest[j]'s index in batch
	for i := range at {
		at[i] = i
	}
	var prior []outcome // by rest index: permanent failures to record
	suspect := false
	for len(rest) > 0 {
		res, next := g.runSet(ctx, rest, prior, suspect)
		g.settleEnded(rest, res)
		for j, i := range at {
			results[i] = res[j]
		}
		if next == nil {
			break
		}
		// Messages the set run answered keep their answer: their handler does not
		// run twice for one delivery. A permanent failure it found is recorded by the
		// next run, which meets it again without running the handler. The others
		// run there from their claim on.
		var nrest []*groupReq
		var nat []int
		var nprior []outcome
		for j, gr := range rest {
			if next.done[j] {
				continue
			}
			var p outcome
			if next.record[j] {
				// Not recorded yet (whatever res says: the run did not commit).
				p = outcome{kind: outPermanent, err: res[j].err}
			}
			nrest, nat, nprior = append(nrest, gr), append(nat, at[j]), append(nprior, p)
		}
		rest, at, prior = nrest, nat, nprior
		if next.renew {
			suspect = next.suspect
			continue
		}
		if len(rest) == 0 {
			break
		}
		reqs := make([]*groupReq, len(rest))
		for j, gr := range rest {
			if cause := prior[j].err; prior[j].kind == outPermanent {
				gr = &groupReq{req: gr.req, done: gr.done,
					h: func(*message.Message) ([]*message.Message, error) { return nil, cause }}
			}
			reqs[j] = gr
		}
		sub := g.runSavepoints(ctx, reqs)
		g.settleEnded(rest, sub)
		for j, i := range at {
			results[i] = sub[j]
		}
		break
	}
	endBatch(span, batch, results)
	for i, r := range batch {
		r.done <- results[i]
	}
}

// settleEnded records the keys of batch whose handlers ended idem's transaction
// (outEnded in res), one fresh transaction each. The batch holds no connection then.
func (g *groupCommitter) settleEnded(batch []*groupReq, res []outcome) {
	for j, o := range res {
		if o.kind == outEnded {
			res[j] = g.c.recordEnded(batch[j].req, o.err)
		}
	}
}

// runSavepoints handles a sorted batch, as the set-based path's fallback: each
// message in its own savepoint with its own claim, effects written as the handler
// enqueues them. It isolates any failing
// message, at about three round trips a message. A transaction holds at most
// maxSavepoints messages: a larger batch runs as several transactions, one after
// another, so that no transaction overflows Postgres's subtransaction cache.
func (g *groupCommitter) runSavepoints(ctx context.Context, batch []*groupReq) []outcome {
	results := make([]outcome, 0, len(batch))
	for chunk := range slices.Chunk(batch, maxSavepoints) {
		results = append(results, g.runSavepointTx(ctx, chunk)...)
	}
	return results
}

// runSavepointTx runs batch, at most maxSavepoints messages, in one transaction,
// each message in its own savepoint.
func (g *groupCommitter) runSavepointTx(ctx context.Context, batch []*groupReq) []outcome {
	c := g.c
	results := make([]outcome, len(batch))
	tx, err := c.beginGroup(ctx)
	if err != nil {
		for i := range results {
			results[i] = outcome{kind: outTransient, err: fmt.Errorf("begin: %w", err)}
		}
		return results
	}
	defer func() { _ = tx.Rollback(ctx) }()
	// Each message runs in savepoint idem_<i>. The SET LOCALs, the release of the
	// previous savepoint, the new SAVEPOINT and the claim travel in one round trip.
	prelude := slices.Clone(c.prelude)
	for i, r := range batch {
		sp := "idem_" + strconv.Itoa(i)
		prelude = append(prelude, "SAVEPOINT "+sp)
		o, broken := g.runOne(ctx, tx, sp, prelude, r)
		results[i] = o
		if broken {
			culprit := i
			if i > 0 && o.claimFailed && savepointGone(o.err) {
				// The RELEASE of the previous savepoint failed: the previous
				// handler ended the transaction and began another.
				culprit = i - 1
				results[culprit] = outcome{kind: outEnded, err: errTxReplaced}
				results[i] = outcome{} // an innocent neighbour, answered by abortBatch
			}
			abortBatch(results, culprit)
			return results
		}
		prelude = []string{"RELEASE SAVEPOINT " + sp}
	}
	_, span := c.child(ctx, spanCommit)
	err = c.commit(ctx, tx)
	endSpan(span, err)
	if err != nil {
		if errors.Is(err, ErrTxEnded) || errors.Is(err, ErrTxAborted) {
			// Every message before the last one was checked by the next one's
			// RELEASE SAVEPOINT; the commit's own check speaks of the last.
			last := len(batch) - 1
			results[last] = outcome{kind: outTransient, err: err}
			if errors.Is(err, ErrTxEnded) {
				results[last].kind = outEnded
			}
			abortBatch(results, last)
			return results
		}
		commitFailed(results, err)
	}
	return results
}

// commitFailed turns every outcome that depended on a batch's COMMIT into a nack.
func commitFailed(results []outcome, err error) {
	for i, o := range results {
		switch o.kind {
		case outCommitted, outRecorded, outDuplicate, outReplayed:
			results[i] = outcome{kind: outTransient, err: err}
		}
	}
}

// runOne runs one message in savepoint sp of tx, which the prelude opens. broken
// means tx can commit nothing more; the outcome then carries this message's own
// cause (never the error of a rollback that followed it).
func (g *groupCommitter) runOne(ctx context.Context, tx pgx.Tx, sp string, prelude []string, r *groupReq) (o outcome, broken bool) {
	c := g.c
	rollback := func() error {
		_, err := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT "+sp)
		return err
	}
	// breaks is the outcome of a message whose failure left tx broken, rbErr being
	// the error of the rollback to its savepoint.
	breaks := func(o outcome, rbErr error) (outcome, bool) {
		switch {
		case o.claimFailed:
			// The claim's round trip failed before its SAVEPOINT ran (a statement
			// that could not even be prepared, such as one on a missing table, or
			// the RELEASE of the previous savepoint): its own error is the cause.
			if o.kind != outBusy {
				o.kind = outTransient
			}
		case savepointGone(rbErr):
			// The handler ended the transaction and began another.
			o = outcome{kind: outEnded, err: errTxReplaced}
		case o.kind != outTransient && o.kind != outBusy:
			o = outcome{kind: outTransient, err: fmt.Errorf("roll back to savepoint: %w", rbErr)}
		}
		return o, true
	}
	o = g.guarded(r, tx, prelude)
	if o.kind == outEnded {
		// Nothing may be sent into a transaction the handler ended: it would run,
		// and commit, outside any transaction.
		return o, true
	}
	switch o.kind {
	case outCommitted:
		return o, false
	case outPermanent:
		if err := rollback(); err != nil {
			// Not recorded, so not permanent: a nack, whose redelivery fails again.
			return breaks(outcome{kind: outTransient, err: fmt.Errorf(
				"roll back after a permanent failure (%v): %w", o.err, err)}, err)
		}
		// Record the failure in the same transaction, where the work was.
		res, err := c.store.FailTx(ctx, tx, r.req.claim, failureCode(o.err), truncate(o.err.Error()))
		if err != nil {
			nr := notRecorded(o.err, err)
			if rbErr := rollback(); rbErr != nil {
				return breaks(nr, rbErr)
			}
			return nr, false
		}
		c.noteExpired(r.req, res)
		if !res.Claimed {
			return existingOutcome(res), false
		}
		return outcome{kind: outRecorded, err: o.err}, false
	default:
		if err := rollback(); err != nil {
			return breaks(o, err)
		}
		return o, false
	}
}

// guarded runs the claim and handler, turning a panic into a transient failure of
// this message alone (the worker goroutine must survive it).
func (g *groupCommitter) guarded(r *groupReq, tx pgx.Tx, prelude []string) (o outcome) {
	defer func() {
		if p := recover(); p != nil {
			o = outcome{kind: outTransient, err: fmt.Errorf("handler panicked: %v", p)}
		}
	}()
	return g.c.runInTx(r.req, tx, prelude, r.h)
}

// abortBatch answers a batch whose transaction broke, so that nothing of it commits.
// results[culprit] already holds the culprit's own error. Every other message gets
// ErrBatchAborted, naming the culprit's error, unless its answer was already a nack
// of its own (or a mismatch, which does not depend on this transaction): one broken
// message costs its neighbours a nack, and their redelivery finds their rows (if
// the culprit committed them early) or runs them again.
func abortBatch(results []outcome, culprit int) {
	cause := results[culprit].err
	for i, o := range results {
		if i == culprit {
			continue
		}
		switch o.kind {
		case outTransient, outBusy, outMismatch:
			if o.err != nil {
				continue
			}
		}
		// The culprit's key is left out: it may belong to another tenant.
		results[i] = outcome{kind: outTransient, err: fmt.Errorf("%w (the other message's error: %v)", ErrBatchAborted, cause)}
	}
}
