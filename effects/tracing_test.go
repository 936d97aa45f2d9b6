package effects_test

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/pgtest"
)

func newTracing(t *testing.T) (*sdktrace.TracerProvider, *tracetest.SpanRecorder) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return tp, rec
}

// cause starts the span an effect is enqueued under, with a tracestate.
func cause(t *testing.T, tp trace.TracerProvider) (context.Context, trace.SpanContext) {
	ctx, span := tp.Tracer("test").Start(context.Background(), "handler")
	t.Cleanup(func() { span.End() })
	ts, err := trace.ParseTraceState("idem=1")
	require.NoError(t, err)
	sc := span.SpanContext().WithTraceState(ts)
	return trace.ContextWithSpanContext(ctx, sc), sc
}

func traceparentOf(sc trace.SpanContext) string {
	return "00-" + sc.TraceID().String() + "-" + sc.SpanID().String() + "-" + sc.TraceFlags().String()
}

// storedContext returns an effect row's trace_context, nil for NULL.
func storedContext(t *testing.T, pool *pgxpool.Pool, key string) map[string]string {
	t.Helper()
	var raw *string
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT trace_context::text FROM effects WHERE key = $1`, key).Scan(&raw))
	if raw == nil {
		return nil
	}
	var m map[string]string
	require.NoError(t, json.Unmarshal([]byte(*raw), &m))
	return m
}

// Every way of enqueueing keeps the W3C trace context of the span in its context,
// and nothing without one. A duplicate keeps the first one's.
func TestTracingEnqueueKeepsTraceContext(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	tp, _ := newTracing(t)
	ctx, sc := cause(t, tp)
	other, _ := cause(t, tp)
	want := map[string]string{"traceparent": traceparentOf(sc), "tracestate": "idem=1"}
	scope := effectsdb.Scope{Schema: schema}
	bg := context.Background()

	tx, err := pool.Begin(bg)
	require.NoError(t, err)
	defer tx.Rollback(bg)
	_, err = effectsdb.Enqueue(ctx, tx, scope, effectsdb.Effect{Kind: "mail", Key: "one"})
	require.NoError(t, err)
	_, err = effectsdb.Enqueue(bg, tx, scope, effectsdb.Effect{Kind: "mail", Key: "untraced"})
	require.NoError(t, err)
	res, err := effectsdb.Enqueue(other, tx, scope, effectsdb.Effect{Kind: "mail", Key: "one"})
	require.NoError(t, err)
	require.True(t, res.Duplicate)
	_, err = effects.EnqueueMany(effectsdb.WithScope(ctx, scope), tx, []effects.Effect{{Kind: "mail", Key: "many-1"}, {Kind: "mail", Key: "many-2"}})
	require.NoError(t, err)

	// The buffer path: the trace is the one Enqueue saw, not the one of the write.
	buffered := scope
	buffered.Buffer = effectsdb.NewBuffer()
	_, err = effectsdb.Enqueue(ctx, tx, buffered, effectsdb.Effect{Kind: "mail", Key: "buffered"})
	require.NoError(t, err)
	_, err = effects.EnqueueMany(effectsdb.WithScope(ctx, buffered), tx, []effects.Effect{{Kind: "mail", Key: "buffered-many"}})
	require.NoError(t, err)
	_, err = effectsdb.EnqueueItems(other, tx, buffered.Buffer.Close())
	require.NoError(t, err)
	require.NoError(t, tx.Commit(bg))

	for _, key := range []string{"one", "many-1", "many-2", "buffered", "buffered-many"} {
		require.Equal(t, want, storedContext(t, pool, key), key)
	}
	require.Nil(t, storedContext(t, pool, "untraced"))
}

// capture is a Publisher that keeps what it is given.
type capture struct {
	mu   sync.Mutex
	msgs []*message.Message
	ctxs []trace.SpanContext
}

func (c *capture) Publish(_ string, msgs ...*message.Message) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, m := range msgs {
		c.msgs = append(c.msgs, m)
		c.ctxs = append(c.ctxs, trace.SpanContextFromContext(m.Context()))
	}
	return nil
}

func (c *capture) Close() error { return nil }

func (c *capture) got() []*message.Message {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]*message.Message(nil), c.msgs...)
}

// Each send has a span of its own trace, linked to the trace context its row kept,
// with the kind, key, tenant, attempt and outcome; a Sender gets it in its
// context; PublishSender writes it into the published message in place of the
// stored one.
func TestTracingSendSpans(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	tp, rec := newTracing(t)
	var mu sync.Mutex
	senderSaw := map[string][]trace.SpanContext{}
	flaky := 0
	mail := effects.SenderFunc(func(ctx context.Context, d effects.Delivery) error {
		mu.Lock()
		defer mu.Unlock()
		senderSaw[d.Key] = append(senderSaw[d.Key], trace.SpanContextFromContext(ctx))
		if d.Key == "flaky" && flaky == 0 {
			flaky++
			return errors.New("smtp 451")
		}
		return nil
	})
	pub := &capture{}
	senders := effects.PublishSenders(pub, "out")
	senders["mail"] = mail
	cfg := fastConfig(pool, schema, senders)
	cfg.TracerProvider = tp
	cfg.Propagator = propagation.TraceContext{}
	start(t, cfg)

	ctx, enq := cause(t, tp)
	out := message.NewMessage("0192f0c4-0000-7000-8000-0000000000aa", []byte("hi"))
	out.Metadata.Set("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01") // stale: copied from an input
	pe, err := effects.PublishEffect("out", out)
	require.NoError(t, err)
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	scope := effectsdb.Scope{Schema: schema, Source: effectsdb.Source{Consumer: "payments", Tenant: "acme", Key: "pay-1"}}
	_, err = effects.EnqueueMany(effectsdb.WithScope(ctx, scope), tx, []effects.Effect{{Kind: "mail", Key: "receipt"}, {Kind: "mail", Key: "flaky"}, pe})
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	waitState(t, pool, "mail", "receipt", "done", 30*time.Second)
	waitState(t, pool, "mail", "flaky", "done", 30*time.Second)
	waitState(t, pool, "publish:out", out.UUID, "done", 30*time.Second)

	sends := map[string][]sdktrace.ReadOnlySpan{}
	pgtest.WaitFor(t, 30*time.Second, "four send spans", func() bool {
		sends = map[string][]sdktrace.ReadOnlySpan{}
		for _, s := range rec.Ended() {
			if s.Name() == "idem.send" {
				key := attrOf(s, "idem.effect.key")
				sends[key] = append(sends[key], s)
			}
		}
		return len(sends["receipt"])+len(sends["flaky"])+len(sends[out.UUID]) == 4
	})
	for key, ss := range sends {
		for i, s := range ss {
			require.False(t, s.Parent().IsValid(), "%s: a send starts a trace of its own", key)
			require.NotEqual(t, enq.TraceID(), s.SpanContext().TraceID())
			require.Len(t, s.Links(), 1, key)
			require.Equal(t, enq.TraceID(), s.Links()[0].SpanContext.TraceID(), "%s links to its cause", key)
			require.Equal(t, enq.SpanID(), s.Links()[0].SpanContext.SpanID())
			require.Equal(t, "acme", attrOf(s, "idem.tenant"))
			require.Equal(t, "payments", attrOf(s, "idem.consumer"))
			require.Equal(t, "pay-1", attrOf(s, "idem.key"))
			require.Equal(t, trace.SpanKindProducer, s.SpanKind())
			if key == "flaky" && i == 0 {
				require.Equal(t, "retry", attrOf(s, "idem.outcome"))
				require.Equal(t, "1", attrOf(s, "idem.effect.attempt"))
				require.Equal(t, "Error", s.Status().Code.String())
				require.Equal(t, "smtp 451", s.Status().Description)
				continue
			}
			require.Equal(t, "done", attrOf(s, "idem.outcome"), key)
		}
	}
	require.Equal(t, "2", attrOf(sends["flaky"][1], "idem.effect.attempt"))
	require.Equal(t, "mail", attrOf(sends["receipt"][0], "idem.effect.kind"))
	mu.Lock()
	require.Equal(t, sends["receipt"][0].SpanContext(), senderSaw["receipt"][0].WithRemote(false), "the Sender runs in the send span")
	mu.Unlock()

	msgs := pub.got()
	require.Len(t, msgs, 1)
	send := sends[out.UUID][0].SpanContext()
	require.Equal(t, traceparentOf(send), msgs[0].Metadata.Get("traceparent"),
		"the published message carries the send's trace context, not the stale one")
	require.Equal(t, "hi", string(msgs[0].Payload))
}

// With no provider and no propagator set (the defaults), sends work, record
// nothing, and a published message keeps the metadata it was stored with.
func TestTracingSendOffByDefault(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	tp, rec := newTracing(t) // used for the cause only: the Dispatcher is not given it
	pub := &capture{}
	start(t, fastConfig(pool, schema, effects.PublishSenders(pub, "out")))
	ctx, _ := cause(t, tp)
	out := message.NewMessage("0192f0c4-0000-7000-8000-0000000000bb", []byte("hi"))
	pe, err := effects.PublishEffect("out", out)
	require.NoError(t, err)
	enqueueCtx(t, ctx, pool, schema, pe)
	waitState(t, pool, "publish:out", out.UUID, "done", 30*time.Second)
	require.Empty(t, rec.Ended(), "only the test's own cause span may record, and it has not ended")
	msgs := pub.got()
	require.Len(t, msgs, 1)
	require.Empty(t, msgs[0].Metadata.Get("traceparent"))
	require.NotNil(t, storedContext(t, pool, out.UUID), "the row keeps the cause all the same")
}

func enqueueCtx(t *testing.T, ctx context.Context, pool *pgxpool.Pool, schema string, es ...effects.Effect) {
	t.Helper()
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	for _, e := range es {
		_, err := effects.Enqueue(effects.WithScope(ctx, effects.Scope{Schema: schema}), tx, e)
		require.NoError(t, err)
	}
	require.NoError(t, tx.Commit(ctx))
}

func attrOf(s sdktrace.ReadOnlySpan, key string) string {
	for _, kv := range s.Attributes() {
		if string(kv.Key) == key {
			return kv.Value.String()
		}
	}
	return ""
}
