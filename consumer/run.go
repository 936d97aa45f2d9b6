package consumer

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/tracing"
)

// handleOne is the transactional mode: one transaction per message, in which the
// key is claimed, the handler runs and its work commits with the inbox row.
func (c *engine) handleOne(req *request, h message.HandlerFunc) outcome {
	ctx := req.ctx
	tx, err := c.begin(ctx)
	if err != nil {
		return canceled(ctx, outcome{kind: outTransient, err: fmt.Errorf("begin: %w", err)})
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	o := c.runInTx(req, tx, c.prelude, h)
	switch o.kind {
	case outCommitted:
		_, span := c.child(ctx, spanCommit)
		err := c.commit(ctx, tx)
		endSpan(span, err)
		switch {
		case errors.Is(err, ErrTxEnded):
			o = outcome{kind: outEnded, err: err}
		case err != nil:
			o = outcome{kind: outTransient, err: err}
		}
	case outPermanent:
		_ = tx.Rollback(context.WithoutCancel(ctx))
		o = c.recordFailure(req, o.err)
	}
	if o.kind == outEnded {
		// The connection goes back to the pool (rolling back a transaction the
		// handler began in place of idem's) before the failure is recorded.
		_ = tx.Rollback(context.WithoutCancel(ctx))
		return c.recordEnded(req, o.err)
	}
	return canceled(ctx, o)
}

// canceled reports a transient failure that a cancelled message context caused
// (pgx refuses to send, or cuts, a statement under it) as ErrCanceled: nothing of
// the message was committed.
func canceled(ctx context.Context, o outcome) outcome {
	if o.kind == outTransient && ctx.Err() != nil && errcode.Code(o.err) == "" &&
		(errors.Is(o.err, context.Canceled) || errors.Is(o.err, context.DeadlineExceeded)) {
		o.err = fmt.Errorf("%w (%v)", ErrCanceled, o.err)
	}
	return o
}

func (c *engine) setLockTimeout(ctx context.Context, tx pgx.Tx) error {
	_, err := tx.Exec(ctx, c.prelude[0])
	return err
}

// runInTx claims the key in tx and, if it owns the key, runs the handler and stores
// its output messages, all in tx. It never commits. The prelude statements (SET
// LOCAL, SAVEPOINT) go to the server in the claim's round trip.
func (c *engine) runInTx(req *request, tx pgx.Tx, prelude []string, h message.HandlerFunc) outcome {
	ctx, span := c.child(req.ctx, spanClaim)
	start := time.Now()
	res, err := c.store.ClaimAfterTx(ctx, tx, prelude, req.claim)
	c.metrics.lockWait.WithLabelValues(req.claim.Consumer).Observe(time.Since(start).Seconds())
	if err == nil && span.IsRecording() {
		span.SetAttributes(tracing.Outcome.String(claimOutcome(res)))
	}
	endSpan(span, err)
	if err != nil {
		o := classify(err)
		o.claimFailed = true
		return o
	}
	c.noteExpired(req, res)
	if !res.Claimed {
		return existingOutcome(res)
	}
	return c.runHandler(req, tx, h)
}

// runHandler runs h with tx in its context and stores what it returns.
func (c *engine) runHandler(req *request, tx pgx.Tx, h message.HandlerFunc) outcome {
	return c.runHandlerBuffered(req, tx, ownedTx{tx}, h, nil)
}

// scope is the effects scope of req's handler. With buf, Enqueue adds effects to
// it, for the batch to write them all at once.
func (c *engine) scope(req *request, buf *effectsdb.Buffer) effectsdb.Scope {
	citus, _ := c.citus.Known() // asked before the transaction began
	return effectsdb.Scope{
		Schema: c.cfg.Schema,
		Source: effectsdb.Source{Consumer: req.claim.Consumer, Tenant: req.claim.Tenant, Key: req.claim.Key},
		Kinds:  c.cfg.EffectKinds,
		Buffer: buf,
		Citus:  citus,
	}
}

// handlerContext is the context a handler runs with: its transaction as idem's
// ownedTx (owned, wrapped once by the caller) and its effects scope.
func (c *engine) handlerContext(ctx context.Context, owned pgx.Tx, scope effectsdb.Scope) context.Context {
	return effectsdb.WithScope(context.WithValue(ctx, txKey{}, owned), scope)
}

// runHandlerBuffered is runHandler with effects and output messages going to buf
// (written now when buf is nil). owned is tx as the handler sees it (ownedTx).
func (c *engine) runHandlerBuffered(req *request, tx, owned pgx.Tx, h message.HandlerFunc, buf *effectsdb.Buffer) outcome {
	scope := c.scope(req, buf)
	sctx, span := c.child(req.ctx, spanHandler)
	hctx := c.handlerContext(sctx, owned, scope)
	mark := poisonMark(req.msg)
	out, err := func() (out []*message.Message, err error) {
		req.msg.SetContext(hctx)
		defer req.msg.SetContext(req.msgCtx) // even if h panics: the message is not ours
		defer func() { endSpan(span, err) }()
		return h(req.msg)
	}()
	if err == nil && poisonMark(req.msg) != mark {
		err = c.poisonedInside(req)
	}
	// Before idem sends anything more: a transaction the handler ended would run
	// idem's statements outside any transaction, each committing on its own.
	if serr := txState(tx); serr != nil && (err == nil || errors.Is(serr, ErrTxEnded)) {
		if err != nil {
			serr = fmt.Errorf("%w (the handler returned: %v)", serr, err)
		}
		if errors.Is(serr, ErrTxEnded) {
			return outcome{kind: outEnded, err: serr}
		}
		return outcome{kind: outTransient, err: serr}
	}
	if err == nil {
		err = c.storeOutput(sctx, req, tx, scope, out)
	}
	if err != nil {
		if IsPermanent(err) {
			return outcome{kind: outPermanent, err: err}
		}
		return classify(err)
	}
	return outcome{kind: outCommitted}
}

// outputNamespace is the UUIDv5 namespace of output message IDs.
var outputNamespace = uuid.MustParse("6f1b7a3e-8c44-4d39-9f0e-1d2c3b4a5e60")

// outputUUID is the UUID of the index-th message that consumer's handler returned for
// key (and tenant). It is the same on every run, so a re-run stores nothing new.
func outputUUID(consumer, tenant, key string, index int) string {
	name := consumer + "\x00" + tenant + "\x00" + key + "\x00" + strconv.Itoa(index)
	return uuid.NewSHA1(outputNamespace, []byte(name)).String()
}

// storeOutput stores the handler's returned messages as publish effects, in tx. It
// stores copies with the derived UUIDs and never changes the messages themselves:
// a handler may return a message it did not create, such as the one it received
// (forwarding), and the output's identity must not leak into it. If it did, a retry
// of that message (middleware.Retry outside idem) would claim the output UUID as its
// key and commit the work a second time under a second key.
func (c *engine) storeOutput(ctx context.Context, req *request, tx pgx.Tx, scope effectsdb.Scope, out []*message.Message) error {
	if len(out) == 0 {
		return nil
	}
	// Looked up only now: it walks the whole context chain when there is none.
	topic := message.PublishTopicFromCtx(req.ctx)
	if topic == "" {
		return ErrNoPublishTopic
	}
	scope.Kinds = nil // publish effects are the consumer's own, not the handler's
	for i, m := range out {
		if m == nil {
			return Permanent(fmt.Errorf("the handler returned a nil message at index %d", i))
		}
		m = m.Copy()
		m.UUID = outputUUID(req.claim.Consumer, req.claim.Tenant, req.claim.Key, i)
		e, err := effectsdb.PublishEffect(topic, m)
		if err != nil {
			return Permanent(err)
		}
		if _, err := effectsdb.Enqueue(ctx, tx, scope, e); err != nil {
			return err
		}
	}
	return nil
}
