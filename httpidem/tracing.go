package httpidem

import (
	"context"

	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/tracing"
)

// The spans of a keyed request, under the span in the request's context.
const (
	spanClaim   = "idem.claim"
	spanHandler = "idem.handler"
	spanCommit  = "idem.commit"
)

// startClaim starts the span of q's claim, named after its key.
func (m *Middleware) startClaim(q *request) (context.Context, trace.Span) {
	ctx, span := m.tracer.Start(q.r.Context(), spanClaim)
	if span.IsRecording() {
		span.SetAttributes(tracing.Consumer.String(q.claim.Consumer), tracing.Tenant.String(q.claim.Tenant),
			tracing.Key.String(q.claim.Key))
	}
	return ctx, span
}

// endClaim ends a claim's span with what the claim found.
func endClaim(span trace.Span, res inbox.ClaimResult, err error) {
	if err == nil && span.IsRecording() {
		span.SetAttributes(tracing.Outcome.String(claimOutcome(res)))
	}
	endSpan(span, err)
}

func claimOutcome(res inbox.ClaimResult) string {
	switch {
	case res.Claimed:
		return "claimed"
	case res.Mismatch:
		return "mismatch"
	case res.Existing == nil:
		return "unknown"
	case res.Existing.State == inbox.StateCompleted:
		return "replayed"
	case res.Existing.State == inbox.StateFailed:
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
