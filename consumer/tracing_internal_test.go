package consumer

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/tracing"
)

// BenchmarkNoopTracing is what tracing adds to one message of the per-message path
// with the default (no-op) provider and propagator: the message's span and its
// claim, handler and commit spans, started and ended as handleOne does. The
// message carries a traceparent, which the no-op propagator does not read.
func BenchmarkNoopTracing(b *testing.B) {
	c := &Consumer{tracer: tracing.Tracer(nil), prop: tracing.Propagator(nil)}
	msg := message.NewMessage("0192f0c4-0000-7000-8000-000000000001", []byte(`{}`))
	msg.Metadata.Set("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
	b.ReportAllocs()
	for b.Loop() {
		req := &request{msg: msg, msgCtx: msg.Context()}
		req.ctx, req.span = c.startMessage(msg, "payments")
		_, claim := c.child(req.ctx, spanClaim)
		if req.span.IsRecording() {
			b.Fatal("the default provider records")
		}
		claimOutcome(inbox.ClaimResult{Claimed: true})
		endSpan(claim, nil)
		_, handler := c.child(req.ctx, spanHandler)
		endSpan(handler, nil)
		_, commit := c.child(req.ctx, spanCommit)
		endSpan(commit, nil)
		endMessage(req, outcome{kind: outCommitted})
	}
}
