package consumer_test

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/idemkit/idem/consumer"
)

// docMiddlewareOrder is the guide's snippet (docs/consumers.md) of the router
// middlewares around idem's, outermost first: compiled with the tests, not run.
// examples/quickstart/main.go sets the same order in addPaymentsHandler.
func docMiddlewareOrder(h *message.Handler, pub message.Publisher, idem *consumer.Consumer) {
	poison, _ := middleware.PoisonQueueWithFilter(pub, "payments.poison", consumer.IsPermanent)
	retry := middleware.Retry{MaxRetries: 5, InitialInterval: 100 * time.Millisecond,
		ShouldRetry: consumer.ShouldRetry}
	h.AddMiddleware(poison, retry.Middleware, idem.Middleware)
}

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

var _ = []any{docMiddlewareOrder, docTracingSetup}
