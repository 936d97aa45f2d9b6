// Command observability is docs/observability.md's opening program: the
// OpenTelemetry setup of a service's main, and a NATS consumer behind idem's
// middleware whose spans it prints once a message is handled.
package main

import (
	"context"
	"fmt"
	"log"
	"os"
	"slices"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	natsgo "github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	idemnats "github.com/idemkit/idem/adapters/nats"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/migrate"
)

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	// In production, the exporter of your choice (otlptracegrpc.New(ctx), say).
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	otel.SetTracerProvider(tp)                            // idem's configs leave TracerProvider nil
	otel.SetTextMapPropagator(propagation.TraceContext{}) // W3C headers, read and written by the adapters

	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	check(err)
	defer pool.Close()
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: "docs_observability"}) // idem's tables
	check(err)
	_, err = m.Up(ctx)
	check(err)
	idem, err := consumer.New(consumer.Config{Pool: pool, Schema: "docs_observability"})
	check(err)
	nc, err := natsgo.Connect(os.Getenv("NATS_URL"))
	check(err)
	defer nc.Close()
	topo := idemnats.Topology{AutoProvision: true}
	pub, err := idemnats.NewPublisher(nc, idemnats.PublisherConfig{Topology: topo})
	check(err)
	sub, err := idemnats.NewSubscriber(nc, idemnats.SubscriberConfig{Topology: topo, Durable: "docs-observability"})
	check(err)
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	check(err)
	router.AddConsumerHandler("docs-observability", "docs-observability-orders", sub, func(msg *message.Message) error {
		return nil // its spans: idem.claim, idem.handler, idem.commit in idem.consume
	}).AddMiddleware(idem.Middleware)
	go func() { _ = router.Run(ctx) }()
	defer func() { _ = router.Close() }()
	<-router.Running()

	check(pub.Publish("docs-observability-orders", message.NewMessage(watermill.NewUUID(), []byte(`{}`))))
	var names []string // the message's span, idem.consume, ends after the commit
	for !slices.Contains(names, "idem.consume") && ctx.Err() == nil {
		time.Sleep(50 * time.Millisecond)
		names = names[:0]
		for _, s := range exp.GetSpans() {
			names = append(names, s.Name)
		}
	}
	slices.Sort(names)
	fmt.Println("spans:", slices.Compact(names))
}

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}
