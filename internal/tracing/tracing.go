// Package tracing holds what the consumer and httpidem share for OpenTelemetry:
// the instrumentation scope, the attribute keys, the defaults (the global provider
// and propagator, no-op until the application installs its own) and a carrier over
// Watermill metadata. effects and the adapters keep their own few lines of it, so
// that they import nothing of idem; the scope and keys are the same strings.
//
// Only the OpenTelemetry API is imported here, never the SDK or an exporter: with
// nothing installed by the application, every span is the API's no-op one.
package tracing

import (
	"context"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// ScopeName is the instrumentation scope of every idem span.
const ScopeName = "github.com/idemkit/idem"

// Attribute keys of idem's spans.
const (
	Consumer  = attribute.Key("idem.consumer")
	Tenant    = attribute.Key("idem.tenant")
	Key       = attribute.Key("idem.key")
	Outcome   = attribute.Key("idem.outcome")
	ErrorCode = attribute.Key("idem.error_code")
	Mode      = attribute.Key("idem.mode")
	BatchSize = attribute.Key("idem.batch.size")
	Kind      = attribute.Key("idem.effect.kind")
	EffectKey = attribute.Key("idem.effect.key")
	Attempt   = attribute.Key("idem.effect.attempt")
)

// Tracer returns the idem tracer of tp, or of the global provider when tp is nil.
// The global provider is a no-op until the application calls
// otel.SetTracerProvider, and follows it from then on (also when it is set after
// this call).
func Tracer(tp trace.TracerProvider) trace.Tracer {
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	return tp.Tracer(ScopeName)
}

// Propagator returns p, or the global propagator when p is nil (a no-op until the
// application calls otel.SetTextMapPropagator, and following it from then on).
func Propagator(p propagation.TextMapPropagator) propagation.TextMapPropagator {
	if p == nil {
		return otel.GetTextMapPropagator()
	}
	return p
}

// Metadata is a propagation.TextMapCarrier over Watermill metadata. Get falls back to
// a case-insensitive match, because a broker's headers may have been written in a
// canonical form ("Traceparent"). Set writes the key as given.
type Metadata message.Metadata

// Get returns the value of key.
func (m Metadata) Get(key string) string {
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

// Set sets key to value.
func (m Metadata) Set(key, value string) { m[key] = value }

// Keys lists the keys.
func (m Metadata) Keys() []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

// MessageContext is the context a received message's spans start from: msg's own
// context when it carries a span already (an adapter or a middleware extracted or
// started one), otherwise the trace context that p extracts from its metadata.
func MessageContext(msg *message.Message, p propagation.TextMapPropagator) context.Context {
	ctx := msg.Context()
	if trace.SpanContextFromContext(ctx).IsValid() || len(msg.Metadata) == 0 {
		return ctx
	}
	return p.Extract(ctx, Metadata(msg.Metadata))
}
