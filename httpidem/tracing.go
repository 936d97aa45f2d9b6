package httpidem

import (
	"context"

	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/tracing"
)

// The spans of a keyed request, under the span in the request's context when that
// one records.
const (
	spanClaim   = "idem.claim"
	spanHandler = "idem.handler"
	spanCommit  = "idem.commit"
)

// noSpan is a span that does nothing, for the children of a span that does not
// record.
var noSpan = trace.SpanFromContext(context.Background())

// child starts a span under the span in ctx, only if that one records: without
// one (no tracing middleware outside idem, the default no-op provider, or a
// sampler that dropped the request's trace) the children would record nothing
// either, or be roots of traces of their own, and would cost a context and a
// span value each. ctx is returned as it is then.
func (e *engine) child(ctx context.Context, name string) (context.Context, trace.Span) {
	if !trace.SpanFromContext(ctx).IsRecording() {
		return ctx, noSpan
	}
	return e.tracer.Start(ctx, name)
}

// startClaim starts the span of q's claim, named after its key.
func (e *engine) startClaim(q *request) (context.Context, trace.Span) {
	ctx, span := e.child(q.r.Context(), spanClaim)
	if span.IsRecording() {
		span.SetAttributes(tracing.Consumer.String(q.claim.Consumer), tracing.Tenant.String(q.claim.Tenant),
			tracing.Key.String(q.claim.Key))
	}
	return ctx, span
}

// endClaim ends a claim's span with what the claim found.
func endClaim(span trace.Span, res inboxdb.ClaimResult, err error) {
	if err == nil && span.IsRecording() {
		span.SetAttributes(tracing.Outcome.String(claimOutcome(res)))
	}
	endSpan(span, err)
}

func claimOutcome(res inboxdb.ClaimResult) string {
	switch {
	case res.Claimed:
		return "claimed"
	case res.Mismatch:
		return "mismatch"
	case res.Existing == nil:
		return "unknown"
	case res.Existing.State == inboxdb.StateCompleted:
		return "replayed"
	case res.Existing.State == inboxdb.StateFailed:
		return "replayed_failure"
	default:
		return "busy"
	}
}

func endSpan(span trace.Span, err error) {
	if err != nil && span.IsRecording() {
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}
