package consumer

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/tracing"
)

// BenchmarkNoopTracing is what tracing adds to one message of the per-message path
// with the default (no-op) provider and propagator: the message's span and its
// claim, handler and commit spans, started and ended as handleOne does. The
// message carries a traceparent, which the no-op propagator does not read.
func BenchmarkNoopTracing(b *testing.B) {
	c, msg, req := noopTracing()
	b.ReportAllocs()
	for b.Loop() {
		traceOneMessage(b, c, msg, req)
	}
}

// TestNoopTracingAllocatesNothing: with no tracer provider installed, tracing
// costs a message no allocation at all.
func TestNoopTracingAllocatesNothing(t *testing.T) {
	c, msg, req := noopTracing()
	require.Zero(t, testing.AllocsPerRun(1000, func() { traceOneMessage(t, c, msg, req) }))
}

// noopTracing is a consumer with the default (global, no-op) provider and
// propagator, a message that carries a traceparent, which the no-op propagator
// does not read, and a request to reuse.
func noopTracing() (*engine, *message.Message, *request) {
	c := &engine{tracer: tracing.Tracer(nil), prop: tracing.Propagator(nil)}
	msg := message.NewMessage("0192f0c4-0000-7000-8000-000000000001", []byte(`{}`))
	msg.Metadata.Set("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
	return c, msg, &request{msg: msg, msgCtx: msg.Context()}
}

// traceOneMessage starts and ends a message's spans as handleOne does.
func traceOneMessage(tb testing.TB, c *engine, msg *message.Message, req *request) {
	*req = request{msg: msg, msgCtx: msg.Context()}
	req.ctx, req.span = c.startMessage(msg, "payments")
	_, claim := c.child(req.ctx, spanClaim)
	if req.span.IsRecording() {
		tb.Fatal("the default provider records")
	}
	claimOutcome(inboxdb.ClaimResult{Claimed: true})
	endSpan(claim, nil)
	_, handler := c.child(req.ctx, spanHandler)
	endSpan(handler, nil)
	_, commit := c.child(req.ctx, spanCommit)
	endSpan(commit, nil)
	endMessage(req, outcome{kind: outCommitted})
}
