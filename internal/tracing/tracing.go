// Package tracing holds what idem's packages share for OpenTelemetry: the
// instrumentation scope, the defaults (the global provider and propagator, no-op
// until the application installs its own), a carrier over Watermill metadata, and
// the W3C form in which an effect row keeps its trace context.
//
// Only the OpenTelemetry API is imported here, never the SDK or an exporter: with
// the application's nothing installed, every span is the API's no-op one.
package tracing

import (
	"context"
	"encoding/json"
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

// HasAny reports whether md holds one of the propagator's fields already (a trace
// context that a producer set itself, which idem leaves alone).
func HasAny(md message.Metadata, p propagation.TextMapPropagator) bool {
	for _, f := range p.Fields() {
		if Metadata(md).Get(f) != "" {
			return true
		}
	}
	return false
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

// w3c is how effect rows keep trace context, whatever propagator the application
// uses: the column is for idem to read back, and W3C Trace Context is the format
// every tracing backend understands.
var w3c = propagation.TraceContext{}

// Encode returns sc as the JSON an effect row keeps ({"traceparent": …,
// "tracestate": …}), or "" when sc is not valid (nothing is stored then).
func Encode(sc trace.SpanContext) string {
	if !sc.IsValid() {
		return ""
	}
	c := propagation.MapCarrier{}
	w3c.Inject(trace.ContextWithSpanContext(context.Background(), sc), c)
	b, err := json.Marshal(map[string]string(c))
	if err != nil {
		return ""
	}
	return string(b)
}

// Decode reads what Encode wrote back into a remote span context; an empty or
// unreadable value gives an invalid one.
func Decode(s string) trace.SpanContext {
	if s == "" {
		return trace.SpanContext{}
	}
	var c map[string]string
	if err := json.Unmarshal([]byte(s), &c); err != nil {
		return trace.SpanContext{}
	}
	return trace.SpanContextFromContext(w3c.Extract(context.Background(), propagation.MapCarrier(c)))
}

// Inject writes the trace context of ctx's span with p through set (a broker
// header), unless ctx carries no valid span or md, the message's metadata, holds a
// trace context already: one that a producer set itself is left as it is.
func Inject(ctx context.Context, md message.Metadata, p propagation.TextMapPropagator, set func(key, value string)) {
	if !trace.SpanContextFromContext(ctx).IsValid() || HasAny(md, p) {
		return
	}
	p.Inject(ctx, setter(set))
}

// setter is a write-only propagation.TextMapCarrier.
type setter func(key, value string)

func (s setter) Get(string) string     { return "" }
func (s setter) Set(key, value string) { s(key, value) }
func (s setter) Keys() []string        { return nil }
