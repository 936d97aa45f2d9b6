// Package tracing is idem's one OpenTelemetry glue, shared by the consumer,
// httpidem, effects and both broker adapters: the instrumentation scope, the
// attribute keys, the defaults (the global provider and propagator, no-op until the
// application installs its own), and a carrier over message metadata for reading
// and writing trace context in a broker's headers.
//
// Only the OpenTelemetry API is imported here, never the SDK or an exporter: with
// nothing installed by the application, every span is the API's no-op one. It
// imports nothing of idem and not Watermill (message metadata is a
// map[string]string), so every package can use it.
package tracing

import (
	"context"
	"reflect"
	"strings"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
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

// Off reports whether tracing is off for tp (the global provider when tp is nil):
// tp is the API's no-op provider, or the global provider is still OpenTelemetry's
// default because the application has installed none. Every span started then
// would be a no-op value that records nothing, and starting one still costs a
// context and a span value (allocations on every message), so idem starts none:
// the caller keeps its context as it is (which still carries any span context a
// message brought, for effects to keep). It costs no allocation, and follows the
// global provider: once the application installs one, Off reports false.
//
// OpenTelemetry's eBPF auto-instrumentation, which hooks the default global
// tracer rather than installing a provider, sees none of idem's spans.
func Off(tp trace.TracerProvider) bool {
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	switch tp.(type) {
	case noop.TracerProvider, *noop.TracerProvider:
		return true
	}
	// The default global provider (tp, or one captured before the application
	// installed its own, which it delegates to from then on) is off until then.
	return reflect.TypeOf(tp) == defaultGlobal && reflect.TypeOf(otel.GetTracerProvider()) == defaultGlobal
}

// defaultGlobal is the type of OpenTelemetry's default global provider, which
// delegates to the provider the application installs; nil if one was installed
// before this package was initialized (the default is never returned again then).
var defaultGlobal = func() reflect.Type {
	t := reflect.TypeOf(otel.GetTracerProvider())
	if t.Kind() == reflect.Pointer && t.Elem().PkgPath() == "go.opentelemetry.io/otel/internal/global" {
		return t
	}
	return nil
}()

// Propagator returns p, or the global propagator when p is nil (a no-op until the
// application calls otel.SetTextMapPropagator, and following it from then on).
func Propagator(p propagation.TextMapPropagator) propagation.TextMapPropagator {
	if p == nil {
		return otel.GetTextMapPropagator()
	}
	return p
}

// Metadata is a propagation.TextMapCarrier over message metadata (Watermill's
// message.Metadata converts to it). Get falls back to a case-insensitive match,
// because a broker's headers may have been written in a canonical form
// ("Traceparent") by a producer's client. Set writes the key as given.
type Metadata map[string]string

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

// MessageContext is the context a received message's spans start from: ctx, the
// message's own context, when it carries a span already (an adapter or a
// middleware extracted or started one), otherwise the trace context that p
// extracts from the message's metadata md.
func MessageContext(ctx context.Context, md map[string]string, p propagation.TextMapPropagator) context.Context {
	if trace.SpanContextFromContext(ctx).IsValid() || len(md) == 0 {
		return ctx
	}
	return p.Extract(ctx, Metadata(md))
}

// Inject writes the trace context of ctx's span with p through set (a header of
// the outgoing record), unless ctx carries no valid span or md, the message's
// metadata, holds one of p's fields already: a trace context the producer set
// itself is left as it is.
func Inject(ctx context.Context, md map[string]string, p propagation.TextMapPropagator, set func(key, value string)) {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return
	}
	for _, f := range p.Fields() {
		if Metadata(md).Get(f) != "" {
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
