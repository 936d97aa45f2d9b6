package consumer

import (
	"context"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"cmp"

	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/tracing"
)

// The spans of a message. With the default (no-op) provider each costs a context
// and a no-op span value; attributes are only built for a span that records.
//
//	idem.consume   one per message, parented by the message's trace context; ends
//	               with the outcome, the consumer, tenant and key
//	  idem.claim   the inbox claim (per message modes)
//	  idem.handler the handler, whose context carries this span: effects it
//	               enqueues keep it as their trace context
//	  idem.commit  the COMMIT (per message modes)
//	idem.batch     one per group-commit or HandleBatch batch, linked to each
//	               message's idem.consume span (and each of those to it)
//	  idem.claim   one per round of the set-based path
//	  idem.handler the batch handler (HandleBatch)
//	  idem.commit  the batch's COMMIT
const (
	spanConsume = "idem.consume"
	spanClaim   = "idem.claim"
	spanHandler = "idem.handler"
	spanCommit  = "idem.commit"
	spanBatch   = "idem.batch"
)

// consumerKind is made once: an option made per call costs an allocation.
var consumerKind = trace.WithSpanKind(trace.SpanKindConsumer)

// noSpan is a span that does nothing, for the children of a span that does not
// record.
var noSpan = trace.SpanFromContext(context.Background())

// startMessage starts msg's idem.consume span. With tracing off (no provider
// installed, tracing.Off) it starts none, at no allocation: the context is the
// message's, with any trace context its metadata carried.
func (c *engine) startMessage(msg *message.Message, name string) (context.Context, trace.Span) {
	ctx := tracing.MessageContext(msg.Context(), msg.Metadata, c.prop)
	if tracing.Off(c.cfg.TracerProvider) {
		return ctx, noSpan
	}
	ctx, span := c.tracer.Start(ctx, spanConsume, consumerKind)
	if span.IsRecording() {
		span.SetAttributes(tracing.Consumer.String(name), tracing.Mode.String(c.cfg.Mode.String()),
			attribute.String("messaging.message.id", msg.UUID))
	}
	return ctx, span
}

// child starts a span under the span in ctx, only if that one records: under the
// default no-op provider (or a sampler that dropped the message's trace) the
// children would record nothing either, and would cost a context and a span
// value each. ctx is returned as it is then, so what runs under it (effects'
// Enqueue) still sees the message's span context.
func (c *engine) child(ctx context.Context, name string) (context.Context, trace.Span) {
	if !trace.SpanFromContext(ctx).IsRecording() {
		return ctx, noSpan
	}
	return c.tracer.Start(ctx, name)
}

// endMessage ends req's span with the outcome. It runs once per request.
func endMessage(req *request, o outcome) {
	req.spanDone = true
	span := req.span
	if span == nil {
		return
	}
	defer span.End()
	if !span.IsRecording() {
		return
	}
	name, code, failed := outcomeName(o)
	span.SetAttributes(tracing.Tenant.String(req.claim.Tenant), tracing.Key.String(req.claim.Key),
		tracing.Outcome.String(name))
	if code != "" {
		span.SetAttributes(tracing.ErrorCode.String(code))
	}
	if failed && o.err != nil {
		span.SetStatus(codes.Error, truncate(o.err.Error()))
	}
}

// endPanicked ends the span of a request whose handler panicked: finish never ran.
// It is deferred, and leaves the panic alone for a Recoverer outside.
func endPanicked(req *request) {
	if req == nil || req.spanDone || req.span == nil {
		return
	}
	req.span.SetAttributes(tracing.Outcome.String("panicked"))
	req.span.SetStatus(codes.Error, "the handler panicked")
	req.span.End()
}

// outcomeName names an outcome for spans, with its error code, and whether it is a
// failure (span status Error).
func outcomeName(o outcome) (name, code string, failed bool) {
	switch o.kind {
	case outCommitted:
		return "committed", "", false
	case outDuplicate:
		return "duplicate", "", false
	case outReplayed:
		if o.rec != nil {
			return "replayed", o.rec.ErrorCode, false
		}
		return "replayed", "", false
	case outMismatch:
		return "mismatch", cmp.Or(errcode.Code(o.err), "fingerprint_mismatch"), true
	case outBusy:
		return "busy", "busy", true
	case outTransient:
		return "nacked", cmp.Or(errcode.Code(o.err), "transient"), true
	case outRecorded, outPermanent:
		return "failed", failureCode(o.err), true
	case outRejected:
		return "rejected", failureCode(o.err), true
	}
	return "unknown", "", true
}

// claimOutcome names what a claim found.
func claimOutcome(res inboxdb.ClaimResult) string {
	if res.Claimed {
		return "claimed"
	}
	name, _, _ := outcomeName(existingOutcome(res))
	return name
}

// endSpan ends a child span, marking it failed with err.
func endSpan(span trace.Span, err error) {
	if err != nil && span.IsRecording() {
		span.SetStatus(codes.Error, truncate(err.Error()))
	}
	span.End()
}

// startBatch starts the idem.batch span of a sorted batch and links it and each
// message's span both ways.
func (c *engine) startBatch(batch []*groupReq) (context.Context, trace.Span) {
	if tracing.Off(c.cfg.TracerProvider) {
		return context.Background(), noSpan
	}
	var links []trace.Link
	probe := batch[0].req.span
	if probe != nil && probe.IsRecording() {
		links = make([]trace.Link, 0, len(batch))
		for _, gr := range batch {
			if gr.req.span != nil {
				links = append(links, trace.Link{SpanContext: gr.req.span.SpanContext()})
			}
		}
	}
	ctx, span := c.tracer.Start(context.Background(), spanBatch, trace.WithLinks(links...))
	if span.IsRecording() {
		span.SetAttributes(tracing.BatchSize.Int(len(batch)), tracing.Mode.String(c.cfg.Mode.String()))
		self := trace.Link{SpanContext: span.SpanContext()}
		for _, gr := range batch {
			if gr.req.span != nil {
				gr.req.span.AddLink(self)
			}
		}
	}
	return ctx, span
}

// endBatch ends a batch's span, with an event per message that says its outcome.
func endBatch(span trace.Span, batch []*groupReq, results []outcome) {
	if span.IsRecording() {
		failed := 0
		for i, gr := range batch {
			name, code, bad := outcomeName(results[i])
			if bad {
				failed++
			}
			attrs := []attribute.KeyValue{tracing.Consumer.String(gr.req.claim.Consumer),
				tracing.Tenant.String(gr.req.claim.Tenant), tracing.Key.String(gr.req.claim.Key),
				tracing.Outcome.String(name)}
			if code != "" {
				attrs = append(attrs, tracing.ErrorCode.String(code))
			}
			span.AddEvent("idem.message", trace.WithAttributes(attrs...))
		}
		if failed > 0 {
			span.SetStatus(codes.Error, "some messages of the batch were not committed")
		}
	}
	span.End()
}
