package consumer_test

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
)

// traced is a consumer whose spans go to an in-memory recorder, with W3C
// propagation.
func traced(t *testing.T, mode consumer.Mode, mutate ...func(*consumer.Config)) (*consumer.Consumer, *bundle, *tracetest.SpanRecorder) {
	t.Helper()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	c, b := setup(t, mode, append([]func(*consumer.Config){func(cfg *consumer.Config) {
		cfg.TracerProvider = tp
		cfg.Propagator = propagation.TraceContext{}
	}}, mutate...)...)
	return c, b, rec
}

// incoming is the trace context a producer sent: a message with its traceparent.
func incoming(t *testing.T, id, payload string) (*message.Message, trace.SpanContext) {
	t.Helper()
	var tid trace.TraceID
	var sid trace.SpanID
	_, _ = rand.Read(tid[:])
	_, _ = rand.Read(sid[:])
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled, Remote: true})
	msg := newMsg(id, payload)
	msg.Metadata.Set("traceparent", "00-"+tid.String()+"-"+sid.String()+"-01")
	return msg, sc
}

// spans returns the ended spans named name, in the order they ended.
func spans(rec *tracetest.SpanRecorder, name string) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		if s.Name() == name {
			out = append(out, s)
		}
	}
	return out
}

func attr(s sdktrace.ReadOnlySpan, key string) string {
	for _, kv := range s.Attributes() {
		if string(kv.Key) == key {
			return kv.Value.String()
		}
	}
	return ""
}

// children returns the ended spans whose parent is parent.
func children(rec *tracetest.SpanRecorder, parent trace.SpanContext) map[string]sdktrace.ReadOnlySpan {
	out := map[string]sdktrace.ReadOnlySpan{}
	for _, s := range rec.Ended() {
		if s.Parent().SpanID() == parent.SpanID() && s.Parent().TraceID() == parent.TraceID() {
			out[s.Name()] = s
		}
	}
	return out
}

// storedTrace returns the traceparent an effect row kept, "" for none.
func storedTrace(t *testing.T, b *bundle, key string) string {
	t.Helper()
	var raw *string
	require.NoError(t, b.pool.QueryRow(context.Background(),
		`SELECT trace_context::text FROM effects WHERE key = $1`, key).Scan(&raw))
	if raw == nil {
		return ""
	}
	var tc map[string]string
	require.NoError(t, json.Unmarshal([]byte(*raw), &tc))
	return tc["traceparent"]
}

func traceparent(sc trace.SpanContext) string {
	return "00-" + sc.TraceID().String() + "-" + sc.SpanID().String() + "-01"
}

// In the per-message modes each message gets an idem.consume span, child of the
// trace context it came with, and claim, handler and commit spans under it; the
// effect its handler enqueued keeps the handler span's context; a duplicate, a
// mismatch and a permanent failure say so on their spans.
func TestTracingPerMessage(t *testing.T) {
	t.Parallel()
	for _, mode := range []consumer.Mode{consumer.Transactional, consumer.Lease} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			c, b, rec := traced(t, mode)
			h := c.Middleware(b.bizHandler(nil))
			msg, parent := incoming(t, "pay-1", `{"amount":10}`)
			_, err := h(msg)
			require.NoError(t, err)

			consume := spans(rec, "idem.consume")
			require.Len(t, consume, 1)
			s := consume[0]
			require.Equal(t, parent.TraceID(), s.SpanContext().TraceID(), "the message's span continues the producer's trace")
			require.Equal(t, parent.SpanID(), s.Parent().SpanID())
			require.Equal(t, trace.SpanKindConsumer, s.SpanKind())
			require.Equal(t, "committed", attr(s, "idem.outcome"))
			require.Equal(t, "payments", attr(s, "idem.consumer"))
			require.Equal(t, "pay-1", attr(s, "idem.key"))

			kids := children(rec, s.SpanContext())
			require.Contains(t, kids, "idem.claim")
			require.Contains(t, kids, "idem.handler")
			require.Contains(t, kids, "idem.commit")
			require.Equal(t, "claimed", attr(kids["idem.claim"], "idem.outcome"))
			require.Equal(t, traceparent(kids["idem.handler"].SpanContext()), storedTrace(t, b, "receipt:pay-1"),
				"the effect row keeps the handler span's trace context")
			require.Equal(t, msg.Context(), context.Background(), "the message gets its own context back")

			// A redelivery: a duplicate, under its own delivery's trace.
			again, parent2 := incoming(t, "pay-1", `{"amount":10}`)
			_, err = h(again)
			require.NoError(t, err)
			consume = spans(rec, "idem.consume")
			require.Len(t, consume, 2)
			dup := consume[1]
			require.Equal(t, parent2.TraceID(), dup.SpanContext().TraceID())
			require.Equal(t, "duplicate", attr(dup, "idem.outcome"))
			require.Equal(t, "duplicate", attr(children(rec, dup.SpanContext())["idem.claim"], "idem.outcome"))
			require.NotContains(t, children(rec, dup.SpanContext()), "idem.handler", "a duplicate runs no handler")

			// The same key with another payload.
			other, _ := incoming(t, "pay-1", `{"amount":11}`)
			_, err = h(other)
			require.ErrorIs(t, err, consumer.ErrFingerprintMismatch)
			mm := spans(rec, "idem.consume")[2]
			require.Equal(t, "mismatch", attr(mm, "idem.outcome"))
			require.NotEmpty(t, attr(mm, "idem.error_code"))
			require.Equal(t, "Error", mm.Status().Code.String())

			// A permanent failure, recorded.
			fail := c.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				return nil, consumer.Permanent(errors.New("card declined"))
			})
			bad, _ := incoming(t, "pay-2", `{}`)
			_, err = fail(bad)
			require.NoError(t, err)
			f := spans(rec, "idem.consume")[3]
			require.Equal(t, "failed", attr(f, "idem.outcome"))
			require.Equal(t, "permanent", attr(f, "idem.error_code"))
			require.Equal(t, "Error", children(rec, f.SpanContext())["idem.handler"].Status().Code.String())
		})
	}
}

// A message whose context carries a span already (an adapter extracted it, or a
// middleware started one) is parented by that span, not by its metadata.
func TestTracingPrefersTheMessageContext(t *testing.T) {
	t.Parallel()
	c, b, rec := traced(t, consumer.Transactional)
	msg, fromMetadata := incoming(t, "pay-ctx", `{}`)
	_, local := incoming(t, "unused", `{}`)
	msg.SetContext(trace.ContextWithSpanContext(context.Background(), local))
	_, err := c.Middleware(b.bizHandler(nil))(msg)
	require.NoError(t, err)
	s := spans(rec, "idem.consume")[0]
	require.Equal(t, local.TraceID(), s.SpanContext().TraceID())
	require.NotEqual(t, fromMetadata.TraceID(), s.SpanContext().TraceID())
}

// A group-commit batch has an idem.batch span, linked to each message's span and
// holding the batch's claim and commit; each message keeps its own span under its
// own trace, with its outcome, and its handler span, whose context its effect
// keeps.
func TestTracingGroupCommit(t *testing.T) {
	t.Parallel()
	c, b, rec := traced(t, consumer.GroupCommit, func(cfg *consumer.Config) { cfg.Batch.Workers = 1 })
	// Two deliveries of one key in the batch: the second is a duplicate.
	h := c.Middleware(b.bizHandler(nil))
	const n = 6
	msgs := make([]*message.Message, n)
	parents := make([]trace.SpanContext, n)
	for i := range n {
		id := "gc-" + string(rune('a'+i))
		if i == n-1 {
			id = "gc-a"
		}
		msgs[i], parents[i] = incoming(t, id, `{"amount":1}`)
	}
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			_, err := h(msgs[i])
			require.NoError(t, err)
		})
	}
	wg.Wait()

	consume := spans(rec, "idem.consume")
	require.Len(t, consume, n)
	byTrace := map[trace.TraceID]sdktrace.ReadOnlySpan{}
	for _, s := range consume {
		byTrace[s.SpanContext().TraceID()] = s
	}
	batches := map[trace.SpanID]sdktrace.ReadOnlySpan{}
	for _, s := range spans(rec, "idem.batch") {
		batches[s.SpanContext().SpanID()] = s
	}
	require.NotEmpty(t, batches)
	outcomes := map[string]int{}
	for i, p := range parents {
		s, ok := byTrace[p.TraceID()]
		require.True(t, ok, "message %d has a span in its own trace", i)
		require.Equal(t, p.SpanID(), s.Parent().SpanID())
		outcomes[attr(s, "idem.outcome")]++
		// Linked to its batch, which links back to it.
		require.Len(t, s.Links(), 1)
		batch, ok := batches[s.Links()[0].SpanContext.SpanID()]
		require.True(t, ok, "message %d links to its batch span", i)
		var back bool
		for _, l := range batch.Links() {
			back = back || l.SpanContext.SpanID() == s.SpanContext().SpanID()
		}
		require.True(t, back, "the batch span links to message %d", i)
		if attr(s, "idem.outcome") == "committed" {
			handler := children(rec, s.SpanContext())["idem.handler"]
			require.NotNil(t, handler, "message %d's handler span is under its message span", i)
			require.Equal(t, traceparent(handler.SpanContext()), storedTrace(t, b, "receipt:"+msgs[i].UUID))
		}
	}
	require.Equal(t, map[string]int{"committed": n - 1, "duplicate": 1}, outcomes)
	for _, batch := range batches {
		kids := children(rec, batch.SpanContext())
		require.Contains(t, kids, "idem.claim")
		require.Contains(t, kids, "idem.commit")
		require.Len(t, batch.Events(), len(batch.Links()), "one event per message, with its outcome")
		for _, e := range batch.Events() {
			set := attribute.NewSet(e.Attributes...)
			outcome, _ := set.Value("idem.outcome")
			require.Contains(t, []string{"committed", "duplicate"}, outcome.AsString())
		}
	}
}

// HandleBatch: the batch handler's span is under the batch span, and each
// message's effect keeps the context of that message's own span.
func TestTracingHandleBatch(t *testing.T) {
	t.Parallel()
	c, b, rec := traced(t, consumer.Transactional, func(cfg *consumer.Config) { cfg.Batch.Workers = 1 })
	h := c.HandleBatch(func(ctx context.Context, tx pgx.Tx, msgs []*message.Message) error {
		for _, m := range msgs {
			if _, err := effects.Enqueue(m.Context(), tx, effects.Effect{Kind: "email", Key: "receipt:" + m.UUID, Payload: m.Payload}); err != nil {
				return err
			}
		}
		return nil
	})
	const n = 4
	msgs := make([]*message.Message, n)
	parents := make([]trace.SpanContext, n)
	for i := range n {
		msgs[i], parents[i] = incoming(t, "hb-"+string(rune('a'+i)), `{}`)
	}
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { require.NoError(t, h(msgs[i])) })
	}
	wg.Wait()

	handlers := spans(rec, "idem.handler")
	require.NotEmpty(t, handlers)
	batchIDs := map[trace.SpanID]bool{}
	for _, s := range spans(rec, "idem.batch") {
		batchIDs[s.SpanContext().SpanID()] = true
	}
	for _, s := range handlers {
		require.True(t, batchIDs[s.Parent().SpanID()], "the batch handler's span is under its batch span")
	}
	for i, p := range parents {
		var mine sdktrace.ReadOnlySpan
		for _, s := range spans(rec, "idem.consume") {
			if s.SpanContext().TraceID() == p.TraceID() {
				mine = s
			}
		}
		require.NotNil(t, mine)
		require.Equal(t, "committed", attr(mine, "idem.outcome"))
		require.Equal(t, traceparent(mine.SpanContext()), storedTrace(t, b, "receipt:"+msgs[i].UUID),
			"message %d's effect keeps its own trace", i)
	}
}

// With no provider and no propagator configured (the default: OpenTelemetry's
// global no-op ones), nothing is traced, nothing fails, and effect rows keep no
// trace context.
func TestTracingOffByDefault(t *testing.T) {
	t.Parallel()
	for _, mode := range []consumer.Mode{consumer.Transactional, consumer.GroupCommit, consumer.Lease} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			c, b := setup(t, mode)
			msg, _ := incoming(t, "quiet", `{}`)
			_, err := c.Middleware(b.bizHandler(nil))(msg)
			require.NoError(t, err)
			require.Equal(t, 1, b.bizRows(t, "quiet"))
			require.Equal(t, "", storedTrace(t, b, "receipt:quiet"))
		})
	}
}
