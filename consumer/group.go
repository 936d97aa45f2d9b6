package consumer

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
)

// ErrClosed: the consumer was closed while a message waited for its batch.
var ErrClosed = &Error{code: "closed", msg: "consumer closed"}

// groupCommitter runs group-commit mode: workers take the messages that arrive
// together (up to MaxBatch, waiting at most MaxWait for more) and run them in one
// transaction, each in its own savepoint, then answer them all after the commit.
type groupCommitter struct {
	c     *Consumer
	reqs  chan *groupReq
	stop  chan struct{}
	wg    sync.WaitGroup
	close func()
}

type groupReq struct {
	req  *request
	h    message.HandlerFunc
	done chan outcome
}

func newGroupCommitter(c *Consumer) *groupCommitter {
	g := &groupCommitter{c: c, reqs: make(chan *groupReq), stop: make(chan struct{})}
	g.close = sync.OnceFunc(func() {
		close(g.stop)
		g.wg.Wait()
	})
	for range c.cfg.Workers {
		g.wg.Add(1)
		go g.work()
	}
	return g
}

// submit hands one message to a batch and waits for its outcome.
func (g *groupCommitter) submit(req *request, h message.HandlerFunc) error {
	// One message's cancelled context must not cancel a statement of the shared
	// transaction: pgx closes the connection on cancel, which would fail the batch.
	req.ctx = context.WithoutCancel(req.ctx)
	gr := &groupReq{req: req, h: h, done: make(chan outcome, 1)}
	select {
	case g.reqs <- gr:
	case <-g.stop:
		return g.c.finish(req, outcome{kind: outTransient, err: ErrClosed})
	}
	return g.c.finish(req, <-gr.done)
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
		timer := time.NewTimer(g.c.cfg.MaxWait)
	collect:
		for len(batch) < g.c.cfg.MaxBatch {
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
		g.run(batch)
	}
}

// run handles one batch. Keys are claimed in sorted order, so two batches that
// share keys take their row locks in the same order and cannot deadlock.
func (g *groupCommitter) run(batch []*groupReq) {
	c := g.c
	slices.SortStableFunc(batch, func(a, b *groupReq) int {
		return cmp.Or(cmp.Compare(a.req.claim.Tenant, b.req.claim.Tenant), cmp.Compare(a.req.claim.Key, b.req.claim.Key))
	})
	results := make([]outcome, len(batch))
	answer := func() {
		for i, r := range batch {
			r.done <- results[i]
		}
	}
	defer answer()
	ctx := context.Background()
	tx, err := c.cfg.Pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: c.cfg.IsoLevel})
	if err != nil {
		fillTransient(results, 0, fmt.Errorf("begin: %w", err))
		return
	}
	defer func() { _ = tx.Rollback(ctx) }()
	// Each message runs in savepoint idem_<i>. The SET LOCAL, the release of the
	// previous savepoint, the new SAVEPOINT and the claim travel in one round trip.
	prelude := []string{c.lockTimeoutSQL}
	for i, r := range batch {
		sp := "idem_" + strconv.Itoa(i)
		prelude = append(prelude, "SAVEPOINT "+sp)
		o, err := g.runOne(ctx, tx, sp, prelude, r)
		results[i] = o
		if err != nil {
			// A savepoint could not be set or rolled back: the transaction is
			// broken, so nothing of this batch can commit.
			fillTransient(results, 0, err)
			return
		}
		prelude = []string{"RELEASE SAVEPOINT " + sp}
	}
	if err := tx.Commit(ctx); err != nil {
		for i, o := range results {
			switch o.kind {
			case outCommitted, outRecorded, outDuplicate, outReplayed:
				results[i] = outcome{kind: outTransient, err: fmt.Errorf("%w: %v", ErrCommitUnknown, err)}
			}
		}
	}
}

// runOne runs one message in savepoint sp of tx, which the prelude opens. A
// returned error means tx is broken.
func (g *groupCommitter) runOne(ctx context.Context, tx pgx.Tx, sp string, prelude []string, r *groupReq) (o outcome, broken error) {
	c := g.c
	rollback := func() error {
		_, err := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT "+sp)
		return err
	}
	o = g.guarded(r, tx, prelude)
	// A failed prelude (the SAVEPOINT never ran) shows up below: ROLLBACK TO
	// SAVEPOINT then fails too, and the batch is reported broken.
	switch o.kind {
	case outCommitted:
		return o, nil
	case outPermanent:
		if err := rollback(); err != nil {
			return outcome{kind: outTransient, err: err}, err
		}
		// Record the failure in the same transaction, where the work was.
		res, err := c.store.FailTx(ctx, tx, r.req.claim, failureCode(o.err), truncate(o.err.Error()))
		if err != nil {
			if rbErr := rollback(); rbErr != nil {
				return outcome{kind: outTransient, err: rbErr}, rbErr
			}
			return notRecorded(o.err, err), nil
		}
		if !res.Claimed {
			return existingOutcome(res), nil
		}
		return outcome{kind: outRecorded, err: o.err}, nil
	default:
		if err := rollback(); err != nil {
			return outcome{kind: outTransient, err: err}, err
		}
		return o, nil
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

func fillTransient(results []outcome, from int, err error) {
	for i := from; i < len(results); i++ {
		if results[i].kind == outMismatch || results[i].kind == outRejected {
			continue
		}
		results[i] = outcome{kind: outTransient, err: err}
	}
}
