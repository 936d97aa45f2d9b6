package nats

import (
	"context"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Trace context travels in the headers as any metadata does; the adapter only
// writes it on Publish and reads it on receipt (see the configs' Propagator). This
// is kept in the adapter, not shared, so that it imports nothing of idem.

// propagatorOrGlobal returns p, or the global propagator when p is nil (a no-op
// until the application calls otel.SetTextMapPropagator, and that propagator from
// then on).
func propagatorOrGlobal(p propagation.TextMapPropagator) propagation.TextMapPropagator {
	if p == nil {
		return otel.GetTextMapPropagator()
	}
	return p
}

// metadataCarrier is a propagation.TextMapCarrier over received metadata. Get falls
// back to a case-insensitive match: a producer's client may have written the
// header in a canonical form ("Traceparent").
type metadataCarrier message.Metadata

func (m metadataCarrier) Get(key string) string {
	if v, ok := m[key]; ok {
		return v
	}
	for k, v := range m {
		if strings.EqualFold(k, key) {
			return v
		}
	}
	return ""
}

func (m metadataCarrier) Set(key, value string) { m[key] = value }

func (m metadataCarrier) Keys() []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

// injectTrace writes the trace context of ctx's span with p through set (a
// header), unless ctx carries no valid span or md, the message's metadata, holds
// one of p's fields already: a trace context the producer set itself is left as it
// is.
func injectTrace(ctx context.Context, md message.Metadata, p propagation.TextMapPropagator, set func(key, value string)) {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return
	}
	for _, f := range p.Fields() {
		if metadataCarrier(md).Get(f) != "" {
			return
		}
	}
	p.Inject(ctx, headerSetter(set))
}

// headerSetter is a write-only propagation.TextMapCarrier.
type headerSetter func(key, value string)

func (s headerSetter) Get(string) string     { return "" }
func (s headerSetter) Set(key, value string) { s(key, value) }
func (s headerSetter) Keys() []string        { return nil }
