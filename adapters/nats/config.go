package nats

import (
	"cmp"
	"context"
	"errors"
	"regexp"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/propagation"

	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/tracing"
)

// Defaults. Each is used when the matching config field is left at its zero value.
const (
	// DefaultDuplicateWindow is how long a provisioned stream remembers a
	// Nats-Msg-Id. It is the server's own default: a producer retry that comes
	// later than this is stored again, and the consumer's inbox must drop it.
	DefaultDuplicateWindow = 2 * time.Minute

	// DefaultPublishTimeout bounds one Publish call in sync mode and the wait for
	// each ack in async mode.
	DefaultPublishTimeout = 10 * time.Second

	// DefaultMaxInFlight bounds how many published messages may wait for their
	// ack at once. Publish blocks when the bound is reached.
	DefaultMaxInFlight = 256

	// DefaultCloseTimeout bounds how long the publisher's Close waits for
	// pending acks.
	DefaultCloseTimeout = 30 * time.Second

	// DefaultConcurrency is how many messages one Subscribe call holds at once.
	DefaultConcurrency = 8

	// DefaultMaxAckPending is the consumer's MaxAckPending, unless four times
	// Concurrency is more: the server's own default. MaxAckPending bounds the
	// messages out and unacked across every subscriber of the durable,
	// messages waiting out a nak delay included, so it must stay well above
	// Concurrency times the subscribers, or the server starves all but a few
	// of them.
	DefaultMaxAckPending = 1000

	// DefaultFetchBatch is how many free slots a pull waits for.
	DefaultFetchBatch = 1

	// DefaultAckWait is the consumer's AckWait. A handler may run longer: the
	// subscriber sends InProgress well before AckWait runs out.
	DefaultAckWait = 30 * time.Second

	// DefaultMaxDeliver is the consumer's MaxDeliver. With the default nak
	// backoff (1s doubling up to 5m), 20 deliveries span about an hour, long
	// enough to ride out a short outage of the handler's database, short enough
	// that a message nobody classified as permanent does not hold a
	// MaxAckPending slot for ever.
	DefaultMaxDeliver = 20

	// DefaultNakDelayMin and DefaultNakDelayMax bound the default nak backoff.
	DefaultNakDelayMin = time.Second
	DefaultNakDelayMax = 5 * time.Minute

	// DefaultPullExpiry is how long one pull request waits on the server for
	// messages. It is also about how long Close can take: Close lets the
	// outstanding pull run out, so that no message is sent into an inbox that
	// nobody reads any more (where it would wait out its AckWait).
	DefaultPullExpiry = time.Second

	// DefaultAckTimeout bounds a double ack (AckSync) and each API call the
	// subscriber makes for one message.
	DefaultAckTimeout = 5 * time.Second
)

// Topology says where a topic lives, and whether this package may create it.
// Publisher and Subscriber share it, and must agree on it.
type Topology struct {
	// StreamName maps a topic to the stream that stores it.
	// Default: one stream per topic, named after it (see StreamOf).
	StreamName func(topic string) string

	// Subject maps a topic to the subject its messages are published on.
	// Default: the topic itself.
	Subject func(topic string) string

	// AutoProvision lets the publisher create the stream, and the subscriber
	// the stream and the consumer, when they are missing. An existing stream is
	// used as it is (its config wins). An existing consumer is updated to this
	// package's config (this config wins): see SubscriberConfig.Consumer.
	AutoProvision bool

	// Stream is the template for provisioned streams. Name and Subjects are set
	// per topic; Duplicates defaults to DefaultDuplicateWindow. Everything else
	// (retention, storage, replicas, limits) is passed to the server as it is.
	Stream jetstream.StreamConfig
}

// WithDefaults returns t with every unset field at its default.
func (t Topology) WithDefaults() Topology {
	if t.StreamName == nil {
		t.StreamName = defaultStreamName
	}
	if t.Subject == nil {
		t.Subject = func(topic string) string { return topic }
	}
	t.Stream.Duplicates = cmp.Or(t.Stream.Duplicates, DefaultDuplicateWindow)
	return t
}

// streamConfig is the stream to provision for topic.
func (t *Topology) streamConfig(topic string) jetstream.StreamConfig {
	c := t.Stream
	c.Name = t.StreamName(topic)
	c.Subjects = []string{t.Subject(topic)}
	return c
}

var invalidNameChars = regexp.MustCompile(`[^A-Za-z0-9_-]`)

// StreamOf is the name of the stream that stores topic under t: t.StreamName's,
// or by default the topic with every character that a stream name may not hold
// (".", "*", ">", whitespace, path separators and the like) made "_". Topics that
// differ only in such characters share a default stream name; give
// Topology.StreamName to keep them apart.
func (t Topology) StreamOf(topic string) string {
	if t.StreamName != nil {
		return t.StreamName(topic)
	}
	return defaultStreamName(topic)
}

// defaultStreamName is the default of Topology.StreamName (see StreamOf).
func defaultStreamName(topic string) string {
	return invalidNameChars.ReplaceAllString(topic, "_")
}

func validName(kind, name string) error {
	if name == "" {
		return errcode.InvalidConfig("%s is empty", kind)
	}
	if invalidNameChars.MatchString(name) {
		return errcode.InvalidConfig("%s %q holds a character other than letters, digits, '_' and '-'", kind, name)
	}
	return nil
}

// PublisherConfig configures a Publisher.
type PublisherConfig struct {
	Topology

	// Async makes Publish return once the messages are handed to the client,
	// before the server has acked them. At most MaxInFlight messages wait for
	// an ack; Publish blocks beyond that. A failed ack is logged, counted and
	// passed to OnAsyncError. Close waits for every pending ack.
	//
	// By default (false) Publish returns only when the stream has stored every
	// message, or with the error.
	Async bool

	// MaxInFlight bounds the messages waiting for an ack. Default DefaultMaxInFlight.
	MaxInFlight int

	// PublishTimeout bounds a sync Publish call, and each async ack.
	// Default DefaultPublishTimeout.
	PublishTimeout time.Duration

	// CloseTimeout bounds the wait for pending acks in Close. Default DefaultCloseTimeout.
	CloseTimeout time.Duration

	// OnAsyncError is called, in async mode, for every message the server did not
	// ack. It may publish again: the message keeps its UUID, so the stream drops
	// the copy if the first attempt was stored after all.
	OnAsyncError func(topic string, msg *message.Message, err error)

	// Propagator writes the trace context of a message's context (msg.Context())
	// into its headers when the message's context carries a valid span and its
	// metadata holds no trace context yet. nil means otel.GetTextMapPropagator(): a
	// no-op until the application calls otel.SetTextMapPropagator, and that
	// propagator from then on.
	Propagator propagation.TextMapPropagator

	// Logger: nil means quiet.
	Logger watermill.LoggerAdapter
}

// WithDefaults returns c with every unset field at its default.
func (c PublisherConfig) WithDefaults() PublisherConfig {
	c.Topology = c.Topology.WithDefaults()
	c.MaxInFlight = cmp.Or(c.MaxInFlight, DefaultMaxInFlight)
	c.PublishTimeout = cmp.Or(c.PublishTimeout, DefaultPublishTimeout)
	c.CloseTimeout = cmp.Or(c.CloseTimeout, DefaultCloseTimeout)
	c.Propagator = tracing.Propagator(c.Propagator)
	c.Logger = cmp.Or[watermill.LoggerAdapter](c.Logger, watermill.NopLogger{})
	return c
}

// Validate reports what NewPublisher would refuse in c, every problem at once. It
// checks c.WithDefaults(), so the zero PublisherConfig passes.
func (c PublisherConfig) Validate() error {
	c = c.WithDefaults()
	var errs []error
	if c.MaxInFlight < 1 {
		errs = append(errs, errcode.InvalidConfig("MaxInFlight must be at least 1"))
	}
	if c.PublishTimeout < 0 {
		errs = append(errs, errcode.InvalidConfig("PublishTimeout must not be negative"))
	}
	if c.CloseTimeout < 0 {
		errs = append(errs, errcode.InvalidConfig("CloseTimeout must not be negative"))
	}
	return errors.Join(errs...)
}

// SubscriberConfig configures a Subscriber.
type SubscriberConfig struct {
	Topology

	// Durable names the durable consumer. Every Subscriber with the same
	// Durable on a topic shares its messages (a consumer group). Required.
	Durable string

	// ConsumerName maps a topic to the consumer's name on its stream.
	// Default: Durable. Give it when several topics share one stream, so that
	// their consumers do not collide.
	ConsumerName func(topic string) string

	// Consumer is the template for the provisioned consumer. Durable, Name and
	// FilterSubject are set per topic. AckPolicy must be explicit (its zero
	// value). Defaults: AckWait DefaultAckWait, MaxDeliver DefaultMaxDeliver,
	// MaxAckPending the larger of DefaultMaxAckPending and 4 × Concurrency
	// (a subscriber never asks for more than Concurrency, so MaxAckPending
	// bounds the whole durable, not one subscriber). When AutoProvision is
	// off, the consumer on the server is used as it is, and its AckWait,
	// BackOff and MaxDeliver are what the subscriber goes by.
	Consumer jetstream.ConsumerConfig

	// Concurrency is how many messages one Subscribe call holds (in its channel
	// and in handlers) at once. The subscriber asks the server for no more
	// than that, so no message waits in a client buffer while its AckWait runs.
	// It is also the largest batch a batching handler downstream (idem's
	// group commit) can see from one Subscribe call: set it to a few times
	// the batch size. Default DefaultConcurrency.
	Concurrency int

	// FetchBatch is how many free slots a pull waits for: the subscriber
	// pulls once at least min(FetchBatch, Concurrency) of its slots are free,
	// and asks for as many messages as slots are free. Above 1 it makes
	// fewer, larger pull requests, at the cost of fewer messages held on
	// average (Concurrency - FetchBatch at the low point). A batching handler
	// downstream acks a batch at once, so its pulls are large anyway.
	// Default DefaultFetchBatch (pull as soon as one slot is free).
	FetchBatch int

	// NakDelay gives the redelivery delay for a nacked message from its
	// delivery count (1 on the first delivery).
	// Default: DefaultNakDelayMin on the first delivery, doubling with each
	// further one up to DefaultNakDelayMax.
	NakDelay func(numDelivered uint64) time.Duration

	// AckSync makes an ack a double ack: the subscriber waits until the server
	// confirms it. A double ack that fails is logged, and the message comes
	// back after AckWait. Off by default: a plain ack is one publish, and a lost
	// one also means a redelivery, which the inbox turns into a duplicate.
	AckSync bool

	// ProgressInterval is how often a message still in a handler gets an
	// InProgress, which restarts its AckWait. Default: a third of the shortest
	// of AckWait and the BackOff steps.
	ProgressInterval time.Duration

	// OnMaxDeliver receives every message that reached MaxDeliver without being
	// acked; see MaxDelivered. It may be called more than once for one message.
	// Nil: the message is only logged and counted.
	OnMaxDeliver func(ctx context.Context, d MaxDelivered) error

	// PullExpiry is how long one pull request waits on the server.
	// Default DefaultPullExpiry.
	PullExpiry time.Duration

	// AckTimeout bounds a double ack and the subscriber's own API calls.
	// Default DefaultAckTimeout.
	AckTimeout time.Duration

	// Logger: nil means quiet.
	Logger watermill.LoggerAdapter

	// Propagator reads the trace context of each received message from its
	// headers (its metadata) into msg.Context(), so that the consumer's spans
	// continue the producer's trace. nil means otel.GetTextMapPropagator(): a no-op
	// until the application calls otel.SetTextMapPropagator, and that propagator
	// from then on.
	Propagator propagation.TextMapPropagator
}

// WithDefaults returns c with every unset field at its default.
func (c SubscriberConfig) WithDefaults() SubscriberConfig {
	c.Topology = c.Topology.WithDefaults()
	if c.ConsumerName == nil {
		durable := c.Durable
		c.ConsumerName = func(string) string { return durable }
	}
	c.Concurrency = cmp.Or(c.Concurrency, DefaultConcurrency)
	c.FetchBatch = cmp.Or(c.FetchBatch, DefaultFetchBatch)
	c.Consumer.AckWait = cmp.Or(c.Consumer.AckWait, DefaultAckWait)
	c.Consumer.MaxDeliver = cmp.Or(c.Consumer.MaxDeliver, DefaultMaxDeliver)
	c.Consumer.MaxAckPending = cmp.Or(c.Consumer.MaxAckPending, max(DefaultMaxAckPending, 4*c.Concurrency))
	if c.NakDelay == nil {
		c.NakDelay = exponentialBackoff(DefaultNakDelayMin, DefaultNakDelayMax)
	}
	c.PullExpiry = cmp.Or(c.PullExpiry, DefaultPullExpiry)
	c.AckTimeout = cmp.Or(c.AckTimeout, DefaultAckTimeout)
	c.Logger = cmp.Or[watermill.LoggerAdapter](c.Logger, watermill.NopLogger{})
	c.Propagator = tracing.Propagator(c.Propagator)
	return c
}

// Validate reports what NewSubscriber would refuse in c, every problem at once. It
// checks c.WithDefaults(), so a config that sets only Durable passes.
func (c SubscriberConfig) Validate() error {
	c = c.WithDefaults()
	var errs []error
	if err := validName("Durable", c.Durable); err != nil {
		errs = append(errs, err)
	}
	if c.Concurrency < 1 {
		errs = append(errs, errcode.InvalidConfig("Concurrency must be at least 1"))
	}
	if c.FetchBatch < 1 {
		errs = append(errs, errcode.InvalidConfig("FetchBatch must be at least 1"))
	}
	if c.Consumer.AckPolicy != jetstream.AckExplicitPolicy {
		errs = append(errs, errcode.InvalidConfig("Consumer.AckPolicy must be explicit, not %s", c.Consumer.AckPolicy))
	}
	if c.Consumer.DeliverSubject != "" {
		errs = append(errs, errcode.InvalidConfig("Consumer.DeliverSubject must be empty: the consumer is a pull consumer"))
	}
	if c.Consumer.AckWait < 0 {
		errs = append(errs, errcode.InvalidConfig("Consumer.AckWait must not be negative"))
	}
	if c.ProgressInterval < 0 {
		errs = append(errs, errcode.InvalidConfig("ProgressInterval must not be negative"))
	}
	if c.ProgressInterval > 0 && c.ProgressInterval >= c.Consumer.AckWait {
		errs = append(errs, errcode.InvalidConfig("ProgressInterval %s must be shorter than Consumer.AckWait %s", c.ProgressInterval, c.Consumer.AckWait))
	}
	if c.PullExpiry < 100*time.Millisecond {
		errs = append(errs, errcode.InvalidConfig("PullExpiry must be at least 100ms"))
	}
	if c.AckTimeout <= 0 {
		errs = append(errs, errcode.InvalidConfig("AckTimeout must be positive"))
	}
	return errors.Join(errs...)
}

// exponentialBackoff returns a NakDelay that starts at first on the first
// delivery and doubles with each further delivery, up to limit.
func exponentialBackoff(first, limit time.Duration) func(numDelivered uint64) time.Duration {
	return func(n uint64) time.Duration {
		d := first
		for i := uint64(1); i < n && d < limit; i++ {
			d *= 2
		}
		return minDuration(d, limit)
	}
}

func minDuration(a, b time.Duration) time.Duration {
	if a < b {
		return a
	}
	return b
}
