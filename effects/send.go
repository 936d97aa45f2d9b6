package effects

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"slices"
	"time"

	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/failgroup"
	"github.com/idemkit/idem/internal/text"
	"github.com/idemkit/idem/internal/tracing"
)

// work sends the effects of one lane until its queue is closed. A claim taken from
// the queue after ctx ended is released unsent.
func (d *dispatcher) work(ctx context.Context, l *lane) {
	for c := range l.queue {
		if ctx.Err() != nil {
			d.released.Add(1)
			d.outcomes <- d.release(c)
			continue
		}
		d.outcomes <- d.attempt(c)
	}
}

// attempt carries out one claim, in its send span, and says what to record.
func (d *dispatcher) attempt(c *claimed) outcome {
	ctx, span := d.startSend(c)
	o := d.attemptIn(ctx, c)
	endSend(span, o)
	return o
}

// startSend starts the span of one attempt: the root of a trace of its own (an
// effect is sent after the work that enqueued it ended, maybe hours later, and
// retried), linked to the trace context its row kept. The Sender gets it in ctx,
// so its own spans (an HTTP client's, a publish) nest under it.
func (d *dispatcher) startSend(c *claimed) (context.Context, trace.Span) {
	if tracing.Off(d.cfg.TracerProvider) {
		return c.batch.ctx, noSpan // no provider installed: no span, no allocation
	}
	opts := sendSpanOptions
	if c.trace != "" {
		if sc := effectsdb.DecodeTrace(c.trace); sc.IsValid() {
			opts = append(slices.Clip(opts), trace.WithLinks(trace.Link{SpanContext: sc}))
		}
	}
	ctx, span := d.tracer.Start(c.batch.ctx, "idem.send", opts...)
	if span.IsRecording() {
		span.SetAttributes(tracing.Kind.String(c.Kind), tracing.EffectKey.String(c.Key),
			tracing.Tenant.String(c.Tenant), tracing.Attempt.Int(c.Attempt))
		if c.SourceConsumer != "" {
			span.SetAttributes(tracing.Consumer.String(c.SourceConsumer), tracing.Key.String(c.SourceKey))
		}
	}
	return ctx, span
}

// noSpan is a span that does nothing.
var noSpan = trace.SpanFromContext(context.Background())

// sendSpanOptions are made once: options made per call cost allocations.
var sendSpanOptions = []trace.SpanStartOption{trace.WithNewRoot(), trace.WithSpanKind(trace.SpanKindProducer)}

// endSend ends an attempt's span with its outcome: done, reconciled, retry, dead
// or released (handed back unsent).
func endSend(span trace.Span, o outcome) {
	if span.IsRecording() {
		span.SetAttributes(tracing.Outcome.String(o.label))
		if o.err != "" {
			span.SetStatus(codes.Error, o.err)
		}
	}
	span.End()
}

// attemptIn is attempt in the send span's context.
func (d *dispatcher) attemptIn(ctx context.Context, c *claimed) outcome {
	lease := d.cfg.Lease
	deadline := c.claimedAt.Add(lease - lease/10)
	if time.Until(deadline) < lease/4 {
		// The claim waited in the queue for most of its lease. Sending now could
		// overlap another dispatcher's claim of the same effect once the lease ends.
		return d.release(c)
	}
	shutdown := d.sendCtx

	if c.prevInFlight {
		log := d.log.With(c.logAttrs()...)
		if r, ok := c.lane.sender.(Reconciler); ok {
			done, err := reconcileSafely(ctx, r, c.Delivery)
			switch {
			case err != nil:
				d.m.reconcile.WithLabelValues(c.Kind, "error").Inc()
				d.m.unknown.WithLabelValues(c.Kind).Inc()
				log.Warn("effect outcome unknown: reconcile failed", "error", err)
				return d.failed(c, Indefinite(fmt.Errorf("reconcile: %w", err)), log)
			case done:
				d.m.reconcile.WithLabelValues(c.Kind, "done").Inc()
				log.Info("effect reconciled: the previous attempt took effect")
				return outcome{c: c, state: "done", label: "reconciled"}
			default:
				d.m.reconcile.WithLabelValues(c.Kind, "not_done").Inc()
			}
		} else {
			d.m.unknown.WithLabelValues(c.Kind).Inc()
			if c.Attempt <= c.maxAttempts {
				log.Warn("effect outcome of the previous attempt unknown (lease expired or indefinite error); sending again with the same key")
			}
		}
	}
	if c.Attempt > c.maxAttempts {
		// The last allowed attempt's outcome was unknown, and no Reconcile settled it.
		return d.dead(c, errors.New("attempts exhausted; the outcome of the last attempt is unknown"), c.prevInFlight, d.log.With(c.logAttrs()...))
	}

	c.lane.lag.Observe((c.lagAtClaim + time.Since(c.claimedAt)).Seconds())
	err := sendSafely(ctx, c.lane.sender, c.Delivery)
	if err == nil {
		return outcome{c: c, state: "done", label: "done"}
	}
	log := d.log.With(c.logAttrs()...)
	if ctx.Err() != nil && !errcode.IsPermanent(err) {
		// Cut off by the lease deadline or a forced shutdown: the receiver may have
		// the effect already.
		err = Indefinite(err)
		if shutdown.Err() != nil {
			// A forced shutdown, not the effect's fault: due again at once, and the
			// attempt still counts, since it may have happened.
			o := d.failed(c, err, log)
			o.delay = 0
			return o
		}
	}
	return d.failed(c, err, log)
}

// failed decides between a retry and dead for a failed attempt.
func (d *dispatcher) failed(c *claimed, err error, log *slog.Logger) outcome {
	indefinite := isIndefinite(err)
	if errcode.IsPermanent(err) {
		return d.dead(c, err, indefinite, log)
	}
	if c.Attempt >= c.maxAttempts {
		return d.dead(c, fmt.Errorf("max attempts (%d) reached: %w", c.maxAttempts, err), indefinite, log)
	}
	delay := d.cfg.Backoff.Delay(c.Attempt)
	log.Warn("effect attempt failed; will retry", "error", err, "retry_in", delay, "outcome_unknown", indefinite)
	return outcome{c: c, state: "pending", delay: delay, inFlight: indefinite, err: storedError(err), label: "retry"}
}

func (d *dispatcher) dead(c *claimed, err error, inFlight bool, log *slog.Logger) outcome {
	log.Error("effect dead", "error", err)
	stored := storedError(err)
	return outcome{c: c, state: "dead", inFlight: inFlight, err: stored, label: "dead",
		code: text.Sanitize(errcode.Code(err), 0), masked: failgroup.Mask(stored)}
}

// release gives a claim back unsent: due now, the attempt returned, and in_flight
// as the claim found it.
func (d *dispatcher) release(c *claimed) outcome {
	return outcome{c: c, state: "pending", inFlight: c.prevInFlight, undo: 1, label: "released"}
}

func sendSafely(ctx context.Context, s Sender, dl Delivery) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("sender panicked: %v\n%s", r, debug.Stack())
		}
	}()
	return s.Send(ctx, dl)
}

func reconcileSafely(ctx context.Context, r Reconciler, dl Delivery) (done bool, err error) {
	defer func() {
		if p := recover(); p != nil {
			done, err = false, fmt.Errorf("reconciler panicked: %v\n%s", p, debug.Stack())
		}
	}()
	return r.Reconcile(ctx, dl)
}

// storedError is err as last_error: this is the one place where an error becomes
// stored text. A sender's error may quote a binary response body or a panic value;
// one NUL byte or invalid UTF-8 sequence in it would make Postgres reject the whole
// outcome batch, so the text is sanitized and capped at maxErrorLen bytes.
func storedError(err error) string { return text.Sanitize(err.Error(), maxErrorLen) }
