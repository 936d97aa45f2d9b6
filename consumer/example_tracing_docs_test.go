package consumer_test

import (
	"context"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
)

// docTracingSetup is the guide's snippet (docs/observability.md) of the
// OpenTelemetry setup in a service's main: compiled with the tests, not run.
func docTracingSetup() (shutdown func(context.Context) error) {
	// In production, the exporter of your choice, for example
	// otlptracegrpc.New(ctx) from go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc.
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp))
	otel.SetTracerProvider(tp)                            // idem's configs leave TracerProvider nil
	otel.SetTextMapPropagator(propagation.TraceContext{}) // W3C headers, read and written by the adapters
	// consumer.New, effects.NewDispatcher, httpidem.New, kafka/nats publishers and
	// subscribers: nothing more to set.
	return tp.Shutdown // main defers it
}

var _ = docTracingSetup
