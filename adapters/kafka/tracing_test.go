package kafka_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/effectsdb"
)

// The trace context of a message's context travels in its headers: published
// through PublishSender in a span, a message arrives with that span's trace
// context in msg.Context() (and its traceparent in the metadata). A traceparent the
// producer set itself is kept; without a span, or with the default (no-op)
// propagator, no trace header is written.
func TestTraceContextTravels(t *testing.T) {
	t.Parallel()
	forEachBroker(t, func(t *testing.T, brokers []string) {
		b := setup(t, brokers, 1)
		tp := sdktrace.NewTracerProvider()
		t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
		pubCfg := kafka.PublisherConfig{Propagator: propagation.TraceContext{}, Logger: testLogger()}
		pubCfg.Brokers = brokers
		pub, err := kafka.NewPublisher(pubCfg)
		require.NoError(t, err)
		t.Cleanup(func() { _ = pub.Close() })

		ctx, send := tp.Tracer("test").Start(context.Background(), "idem.send")
		defer send.End()
		viaSender := message.NewMessage(watermill.NewUUID(), []byte("via sender"))
		payload, err := effectsdb.EncodeMessage(viaSender)
		require.NoError(t, err)
		require.NoError(t, effects.PublishSender(pub).Send(ctx, effects.Delivery{Kind: effects.PublishKindPrefix + b.topic, Key: viaSender.UUID, Payload: payload, Attempt: 1}))

		own := message.NewMessage(watermill.NewUUID(), []byte("own traceparent"))
		own.Metadata.Set("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
		own.SetContext(ctx)
		untraced := message.NewMessage(watermill.NewUUID(), []byte("untraced"))
		quiet := message.NewMessage(watermill.NewUUID(), []byte("default propagator"))
		quiet.SetContext(ctx)
		require.NoError(t, pub.Publish(b.topic, own, untraced))
		require.NoError(t, b.pub.Publish(b.topic, quiet)) // b.pub has no Propagator

		cfg := subscriberConfig(b.brokers, b.group, 1)
		cfg.Propagator = propagation.TraceContext{}
		_, ch := b.subscribe(t, cfg)
		got := map[string]*message.Message{}
		for range 4 {
			m := receive(t, ch)
			got[string(m.Payload)] = m
			m.Ack()
		}
		sc := trace.SpanContextFromContext(got["via sender"].Context())
		require.Equal(t, send.SpanContext().TraceID(), sc.TraceID(), "the message arrives in the send's trace")
		require.Equal(t, send.SpanContext().SpanID(), sc.SpanID())
		require.True(t, sc.IsRemote())
		require.NotEmpty(t, got["via sender"].Metadata.Get("traceparent"))

		require.Equal(t, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", got["own traceparent"].Metadata.Get("traceparent"))
		require.Equal(t, "0af7651916cd43dd8448eb211c80319c", trace.SpanContextFromContext(got["own traceparent"].Context()).TraceID().String())

		require.Empty(t, got["untraced"].Metadata.Get("traceparent"))
		require.False(t, trace.SpanContextFromContext(got["untraced"].Context()).IsValid())
		require.Empty(t, got["default propagator"].Metadata.Get("traceparent"))
	})
}
