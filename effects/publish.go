package effects

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/tracing"
)

type propagatorKey struct{}

// withPropagator puts the Dispatcher's propagator in the sends' context, for
// PublishSender.
func withPropagator(ctx context.Context, p propagation.TextMapPropagator) context.Context {
	return context.WithValue(ctx, propagatorKey{}, p)
}

// propagatorFrom returns the propagator withPropagator put in ctx, or the global one.
func propagatorFrom(ctx context.Context) propagation.TextMapPropagator {
	if p, ok := ctx.Value(propagatorKey{}).(propagation.TextMapPropagator); ok {
		return p
	}
	return tracing.Propagator(nil)
}

// PublishSender forwards stored Watermill messages to pub. It serves kinds
// "publish:<topic>" and publishes to <topic>; the message keeps the UUID and
// metadata it was stored with, so the broker and the next consumer's inbox see one
// ID on every attempt. Register it with PublishSenders, once per topic.
//
// The effect's tenant, when it has one, goes into the TenantMetadataKey metadata
// field, unless the message already sets that field itself.
//
// When ctx carries a valid span (the Dispatcher's send span, with tracing set up),
// the message's metadata gets its trace context, written by the Dispatcher's
// Config.Propagator (the global propagator when PublishSender runs outside a
// Dispatcher), in place of any trace context stored with the message.
//
// A payload that does not decode, or a kind that is not a publish kind, is a
// permanent failure. A publish error is transient and retried. Publishers that
// de-duplicate by ID (NATS JetStream's Nats-Msg-Id) drop the repeats of a retry;
// for the others the next consumer's inbox does.
func PublishSender(pub message.Publisher) Sender {
	return SenderFunc(func(ctx context.Context, d Delivery) error {
		topic, ok := effectsdb.TopicOf(d.Kind)
		if !ok || topic == "" {
			return Permanent(fmt.Errorf("kind %q is not %s<topic>", d.Kind, PublishKindPrefix))
		}
		msg, err := effectsdb.DecodeMessage(d.Payload)
		if err != nil {
			return Permanent(err)
		}
		if d.Tenant != "" && msg.Metadata.Get(TenantMetadataKey) == "" {
			msg.Metadata.Set(TenantMetadataKey, d.Tenant)
		}
		if trace.SpanContextFromContext(ctx).IsValid() {
			// The send's trace context replaces one stored with the message (a
			// handler that forwards its input copies the input's): the next
			// consumer continues from this send, which links back to the cause.
			p := propagatorFrom(ctx)
			for _, f := range p.Fields() {
				delete(msg.Metadata, f)
			}
			p.Inject(ctx, propagation.MapCarrier(msg.Metadata))
		}
		msg.SetContext(ctx)
		return pub.Publish(topic, msg)
	})
}

// PublishSenders returns Config.Senders entries that publish to pub for each topic:
// {"publish:<topic>": PublishSender(pub)}. Topics are listed explicitly, not matched
// by prefix, so a dispatcher claims exactly the kinds it can send; merge the map
// with your other senders.
func PublishSenders(pub message.Publisher, topics ...string) map[string]Sender {
	s := PublishSender(pub)
	m := make(map[string]Sender, len(topics))
	for _, t := range topics {
		m[effectsdb.PublishKind(t)] = s
	}
	return m
}

// PublishEffect makes the effect that publishes msg to topic (its UUID, metadata
// and payload) once the transaction commits, for a PublishSender of that topic
// (see PublishSenders). Its key is the message's UUID, so a message is enqueued
// once however often the handler runs: make the UUID once per command.
func PublishEffect(topic string, msg *message.Message) (Effect, error) {
	e, err := effectsdb.PublishEffect(topic, msg)
	return Effect(e), err
}
