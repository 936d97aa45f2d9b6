package kafka

import (
	"cmp"
	"errors"
	"math"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel/propagation"

	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/tracing"
)

// Defaults of PublisherConfig and SubscriberConfig.
const (
	// Publisher defaults. kafka-go's own defaults are tuned for throughput of
	// fire-and-forget producers; these are tuned for a synchronous Publish that
	// returns once the broker has the message.

	// DefaultBatchTimeout bounds how long the Writer waits to fill a batch.
	// kafka-go's default of 1 s would dominate every single-message Publish.
	DefaultBatchTimeout = 2 * time.Millisecond
	// DefaultBatchSize is the number of messages per partition batch.
	DefaultBatchSize = 1000
	// DefaultMetadataTTL is how long the publisher's transport caches topic
	// metadata. kafka.DefaultTransport keeps it for 6 s, so a partition added
	// to a topic stays unseen for that long.
	DefaultMetadataTTL = time.Second
	// DefaultTopicWait is how long Publish waits for a topic's metadata
	// before it fails.
	DefaultTopicWait = 10 * time.Second
	// DefaultRequiredAcks waits for every in-sync replica (acks=all).
	DefaultRequiredAcks = kafka.RequireAll
	// DefaultMaxAttempts is how many times a write is tried before Publish fails.
	DefaultMaxAttempts = 10

	// Subscriber defaults. They favour correctness (commit only what was acked)
	// and fast rebalances: kafka-go's MaxWait of 10 s and HeartbeatInterval of
	// 3 s make a rebalance and a Close take about 9 s.

	// DefaultMaxWait is the longest a fetch waits for new data. It also bounds
	// how long stopping a partition reader takes.
	DefaultMaxWait = 250 * time.Millisecond
	// DefaultHeartbeatInterval is how often a member tells the coordinator it
	// is alive. A rebalance is noticed within one interval.
	DefaultHeartbeatInterval = 500 * time.Millisecond
	// DefaultSessionTimeout is how long the coordinator waits for a heartbeat
	// before it declares a member dead and hands its partitions to others.
	DefaultSessionTimeout = 10 * time.Second
	// DefaultRebalanceTimeout is how long the coordinator waits for members
	// to rejoin during a rebalance.
	DefaultRebalanceTimeout = 10 * time.Second
	// DefaultJoinGroupBackoff is the pause before rejoining after an error.
	DefaultJoinGroupBackoff = 500 * time.Millisecond
	// DefaultCommitInterval is how often acked offsets are committed.
	// Commits are coalesced, never advanced past an unacked message, and
	// flushed when a partition is released.
	DefaultCommitInterval = 100 * time.Millisecond
	// DefaultReadBackoffMin and DefaultReadBackoffMax bound the pause after a
	// failed fetch; it doubles from the first to the second while fetches
	// keep failing. They are kafka-go's defaults.
	DefaultReadBackoffMin = 100 * time.Millisecond
	DefaultReadBackoffMax = time.Second
	// DefaultNackBackoff is the pause before a nacked record is delivered
	// again the first time. It doubles with each nack of the same record in a
	// row, up to DefaultNackBackoffMax.
	DefaultNackBackoff = 100 * time.Millisecond
	// DefaultNackBackoffMax caps the pause before a record nacked again and
	// again is delivered again.
	DefaultNackBackoffMax = 10 * time.Second
	// DefaultMaxConcurrentPartitions is how many partitions may have a message
	// in flight at the same time, per Subscribe call.
	DefaultMaxConcurrentPartitions = 64
	// DefaultMaxInFlightPerPartition is how many records of one partition may
	// be unacked at once: one, so records are delivered in partition order,
	// each after the previous one's ack.
	DefaultMaxInFlightPerPartition = 1
	// DefaultTopicPartitions is the partition count SubscribeInitialize uses.
	DefaultTopicPartitions = 1
	// DefaultTopicReplicationFactor is the replication factor
	// SubscribeInitialize uses; -1 asks the broker for its default
	// (Kafka 2.4 and later).
	DefaultTopicReplicationFactor = -1
)

// PartitionKeyFunc picks the Kafka record key of a message. Records with the
// same key go to the same partition and are therefore delivered in order.
// A nil key lets the balancer choose a partition.
type PartitionKeyFunc func(topic string, msg *message.Message) ([]byte, error)

// PartitionKeyFromMetadata keys records by the value of a metadata field.
// A message without that field gets a nil key.
func PartitionKeyFromMetadata(field string) PartitionKeyFunc {
	return func(_ string, msg *message.Message) ([]byte, error) {
		if v := msg.Metadata.Get(field); v != "" {
			return []byte(v), nil
		}
		return nil, nil
	}
}

// PublisherConfig configures a Publisher. It embeds kafka-go's own
// kafka.WriterConfig, as SubscriberConfig embeds kafka.ReaderConfig, and adds
// what idem needs. Unset fields get this package's defaults, not kafka-go's.
//
// WriterConfig carries kafka-go's knobs. The ones this package reads are Brokers
// (required), Dialer (its DialFunc, ClientID, TLS and SASLMechanism, for the
// connections to the brokers), Balancer, MaxAttempts, BatchSize, BatchBytes,
// BatchTimeout, ReadTimeout, WriteTimeout, RebalanceInterval (how long the
// brokers' topic metadata is cached), IdleConnTimeout, RequiredAcks, Async,
// CompressionCodec, Logger and ErrorLogger. Topic must stay empty: the topic
// comes from Publish. QueueCapacity has no effect. (kafka-go keeps WriterConfig
// for compatibility and otherwise configures its Writer field by field; a Writer
// holds a mutex and cannot be copied inside a config, so WriterConfig is the
// kafka-go config that a config can carry.)
type PublisherConfig struct {
	kafka.WriterConfig

	// PartitionKey picks each record's key. Nil means no key (the balancer
	// spreads records over partitions, so there is no order between them).
	PartitionKey PartitionKeyFunc

	// WriteBackoffMin and WriteBackoffMax bound the pause between two attempts
	// of a write: kafka.Writer's fields of those names, which WriterConfig
	// lacks. Zero takes kafka-go's defaults.
	WriteBackoffMin time.Duration
	WriteBackoffMax time.Duration

	// AllowAutoTopicCreation lets the broker create unknown topics on
	// publish, if the broker allows it.
	AllowAutoTopicCreation bool

	// TopicWait is how long Publish keeps trying while the topic's metadata
	// is not available: a topic created a moment ago and not yet in the
	// metadata cache, or a first metadata request that failed or timed out
	// (a busy broker, a broker restarting). Nothing is written meanwhile, so
	// trying again writes no record twice. Default: DefaultTopicWait.
	TopicWait time.Duration

	// Transport, when set, talks to the brokers instead of the one this
	// package makes: a kafka.Transport built from Dialer, with MetadataTTL =
	// RebalanceInterval (DefaultMetadataTTL by default) and metadata requests
	// that name only the topics this Publisher has published to, owned and
	// closed by the Publisher. (kafka.DefaultTransport asks for every topic of
	// the cluster at each refresh, which on a cluster with thousands of
	// partitions is a large answer to wait for.)
	Transport kafka.RoundTripper

	// Propagator writes the trace context of a message's context (msg.Context())
	// into its headers when the message's context carries a valid span and its
	// metadata holds no trace context yet. nil means otel.GetTextMapPropagator(): a
	// no-op until the application calls otel.SetTextMapPropagator, and that
	// propagator from then on.
	Propagator propagation.TextMapPropagator

	// Logger; nil means quiet. (WriterConfig's Logger and ErrorLogger, kafka-go's
	// own, are passed to the Writer.)
	Logger watermill.LoggerAdapter
}

// WithDefaults returns c with every unset field at its default.
func (c PublisherConfig) WithDefaults() PublisherConfig {
	c.Balancer = cmp.Or[kafka.Balancer](c.Balancer, &kafka.Hash{})
	c.RequiredAcks = cmp.Or(c.RequiredAcks, int(DefaultRequiredAcks))
	c.MaxAttempts = cmp.Or(c.MaxAttempts, DefaultMaxAttempts)
	c.BatchSize = cmp.Or(c.BatchSize, DefaultBatchSize)
	c.BatchTimeout = cmp.Or(c.BatchTimeout, DefaultBatchTimeout)
	c.RebalanceInterval = cmp.Or(c.RebalanceInterval, DefaultMetadataTTL)
	c.TopicWait = cmp.Or(c.TopicWait, DefaultTopicWait)
	c.Dialer = cmp.Or(c.Dialer, kafka.DefaultDialer)
	c.Propagator = tracing.Propagator(c.Propagator)
	c.Logger = cmp.Or[watermill.LoggerAdapter](c.Logger, watermill.NopLogger{})
	return c
}

// Validate reports what NewPublisher would refuse in c, every problem at once. It
// checks c.WithDefaults(), so a config that sets only Brokers passes.
func (c PublisherConfig) Validate() error {
	c = c.WithDefaults()
	errs := []error{brokersError(c.Brokers)}
	if c.Topic != "" {
		errs = append(errs, errcode.InvalidConfig("Topic must be empty: the topic comes from Publish"))
	}
	if c.MaxAttempts < 0 || c.BatchSize < 0 || c.BatchBytes < 0 {
		errs = append(errs, errcode.InvalidConfig("MaxAttempts, BatchSize and BatchBytes must not be negative"))
	}
	if c.BatchTimeout < 0 || c.ReadTimeout < 0 || c.WriteTimeout < 0 || c.RebalanceInterval < 0 || c.IdleConnTimeout < 0 ||
		c.WriteBackoffMin < 0 || c.WriteBackoffMax < 0 || c.TopicWait < 0 {
		errs = append(errs, errcode.InvalidConfig("durations must not be negative"))
	}
	switch kafka.RequiredAcks(c.RequiredAcks) {
	case kafka.RequireAll, kafka.RequireOne:
	default:
		errs = append(errs, errcode.InvalidConfig("RequiredAcks %d is not RequireAll (-1) or RequireOne (1); use Async not to wait", c.RequiredAcks))
	}
	return errors.Join(errs...)
}

// brokersError is what both configs' Validate report of Brokers: nil, which
// errors.Join drops, when it names a broker.
func brokersError(brokers []string) error {
	if len(brokers) == 0 {
		return errcode.InvalidConfig("Brokers is empty")
	}
	return nil
}

// SubscriberConfig configures a Subscriber.
//
// ReaderConfig carries kafka-go's knobs. The ones this package reads are
// Brokers, GroupID, Dialer, GroupBalancers, HeartbeatInterval,
// SessionTimeout, RebalanceTimeout, JoinGroupBackoff, RetentionTime,
// WatchPartitionChanges, PartitionWatchInterval, StartOffset, CommitInterval,
// MinBytes, MaxBytes, MaxWait, ReadBackoffMin, ReadBackoffMax,
// IsolationLevel, Logger and ErrorLogger. Topic, GroupTopics and Partition
// must stay empty: the topic comes from Subscribe, and partitions from the
// group or from Partitions.
//
// Records are read with Fetch requests through kafka-go's protocol API, not
// with kafka.Reader (which hands out transaction markers and, under
// ReadCommitted, records of aborted transactions). So QueueCapacity,
// ReadBatchTimeout, ReadLagInterval and MaxAttempts have no effect, and of
// the Dialer the fetches use DialFunc, ClientID, TLS and SASLMechanism (the
// consumer group uses all of it).
//
// With GroupID set, the Subscriber joins that consumer group and commits
// offsets after acks. Without it, it reads Partitions (all of the topic's
// when empty) from StartOffset and commits nothing.
type SubscriberConfig struct {
	kafka.ReaderConfig

	// Partitions are the partitions read without a group. Empty: all.
	Partitions []int

	// NackBackoff and NackBackoffMax bound the pause before a nacked record
	// is delivered again: NackBackoff after its first nack, doubling with
	// each nack of the same record in a row, up to NackBackoffMax. The count
	// is per record (partition and offset) and starts again when the record
	// is acked or its partition is revoked, so a record that can never
	// succeed (one without its business key, say, and no PoisonQueue) is
	// redelivered every NackBackoffMax instead of NackBackoff, and the
	// records of other partitions are not slowed. Each new pause is logged
	// once, with the code a handler or middleware put in consumer.MetadataErrorCode.
	// Defaults: DefaultNackBackoff and DefaultNackBackoffMax (at least
	// NackBackoff). Set both to the same value for a fixed pause.
	NackBackoff    time.Duration
	NackBackoffMax time.Duration

	// MaxConcurrentPartitions is how many partitions of one Subscribe call
	// may each have a message in flight at once. More exactly, one Subscribe
	// call has at most MaxConcurrentPartitions × MaxInFlightPerPartition
	// records in handlers at once, and partitions waiting for room take
	// turns.
	MaxConcurrentPartitions int

	// MaxInFlightPerPartition is how many records of one partition may be
	// delivered and not yet acked at once (a nacked record waiting for its
	// redelivery counts). Default 1: partition order, one record at a time.
	//
	// Above 1, records of one partition go out before earlier ones are
	// acked, so that a handler that batches (idem's group commit) gets many
	// at once even from few partitions. Order is then kept per key: a record
	// is delivered only once every earlier record of its partition with the
	// same key is acked. Records without a key (nil or empty) share one key,
	// so they keep partition order among themselves, unless
	// UnorderedWithoutKey. The committed offset never passes a record that
	// is not acked: a nacked record holds the commit back (not the
	// delivery of later records) until it is acked. A partition reads at
	// most 16 × MaxInFlightPerPartition records past its oldest unacked one.
	MaxInFlightPerPartition int

	// UnorderedWithoutKey, with MaxInFlightPerPartition above 1, lets records
	// without a key (nil or empty) be in flight together, in any order. By
	// default they keep partition order among themselves, as if they shared
	// one key: a producer that sets no key may still count on the order of
	// a partition. Records with a key keep key order either way.
	UnorderedWithoutKey bool

	// TopicPartitions and TopicReplicationFactor are used by
	// SubscribeInitialize when it creates a topic.
	TopicPartitions        int
	TopicReplicationFactor int

	// Logger; nil means quiet.
	Logger watermill.LoggerAdapter

	// Registerer gets the Subscriber's metrics (MetricPartitionHeld and
	// MetricPartitionHeldOffset): which partitions a record nacked with a
	// permanent error holds, and at which offset. nil registers none. Several
	// Subscribers may share one Registerer.
	Registerer prometheus.Registerer

	// Propagator reads the trace context of each received message from its
	// headers (its metadata) into msg.Context(), so that the consumer's spans
	// continue the producer's trace. nil means otel.GetTextMapPropagator(): a no-op
	// until the application calls otel.SetTextMapPropagator, and that propagator
	// from then on.
	Propagator propagation.TextMapPropagator
}

// WithDefaults returns c with every unset field at its default.
func (c SubscriberConfig) WithDefaults() SubscriberConfig {
	c.MaxWait = cmp.Or(c.MaxWait, DefaultMaxWait)
	c.HeartbeatInterval = cmp.Or(c.HeartbeatInterval, DefaultHeartbeatInterval)
	c.SessionTimeout = cmp.Or(c.SessionTimeout, DefaultSessionTimeout)
	c.RebalanceTimeout = cmp.Or(c.RebalanceTimeout, DefaultRebalanceTimeout)
	c.JoinGroupBackoff = cmp.Or(c.JoinGroupBackoff, DefaultJoinGroupBackoff)
	c.ReadBackoffMin = cmp.Or(c.ReadBackoffMin, DefaultReadBackoffMin)
	c.ReadBackoffMax = cmp.Or(c.ReadBackoffMax, max(DefaultReadBackoffMax, c.ReadBackoffMin))
	c.CommitInterval = cmp.Or(c.CommitInterval, DefaultCommitInterval)
	c.StartOffset = cmp.Or(c.StartOffset, kafka.FirstOffset)
	c.NackBackoff = cmp.Or(c.NackBackoff, DefaultNackBackoff)
	c.NackBackoffMax = cmp.Or(c.NackBackoffMax, max(DefaultNackBackoffMax, c.NackBackoff))
	c.MaxConcurrentPartitions = cmp.Or(c.MaxConcurrentPartitions, DefaultMaxConcurrentPartitions)
	c.MaxInFlightPerPartition = cmp.Or(c.MaxInFlightPerPartition, DefaultMaxInFlightPerPartition)
	c.TopicPartitions = cmp.Or(c.TopicPartitions, DefaultTopicPartitions)
	c.TopicReplicationFactor = cmp.Or(c.TopicReplicationFactor, DefaultTopicReplicationFactor)
	c.Dialer = cmp.Or(c.Dialer, kafka.DefaultDialer)
	c.Logger = cmp.Or[watermill.LoggerAdapter](c.Logger, watermill.NopLogger{})
	c.Propagator = tracing.Propagator(c.Propagator)
	return c
}

// maxGroupTimeout is the longest duration the group protocol can carry: an
// int32 of milliseconds.
const maxGroupTimeout = time.Duration(math.MaxInt32) * time.Millisecond

// validateGroupTimings checks what the group protocol and Kafka's own
// guidance need. The broker's bounds (group.min.session.timeout.ms, 6 s by
// default, and group.max.session.timeout.ms, 30 min) cannot be known here;
// a SessionTimeout outside them fails Subscribe with a GroupRefusedError
// that names them.
func (c SubscriberConfig) validateGroupTimings() []error {
	var errs []error
	for _, d := range []struct {
		name string
		v    time.Duration
	}{
		{"SessionTimeout", c.SessionTimeout},
		{"HeartbeatInterval", c.HeartbeatInterval},
		{"RebalanceTimeout", c.RebalanceTimeout},
	} {
		if d.v < time.Millisecond || d.v > maxGroupTimeout {
			errs = append(errs, errcode.InvalidConfig("%s %s must be between 1ms and %s: the group protocol carries it in whole milliseconds",
				d.name, d.v, maxGroupTimeout))
		}
	}
	// Kafka's guidance: heartbeats at most a third of the session, so that
	// one late or lost heartbeat does not cost the membership (and every
	// member a rebalance).
	if c.HeartbeatInterval > c.SessionTimeout/3 {
		errs = append(errs, errcode.InvalidConfig("HeartbeatInterval %s must be at most a third of SessionTimeout %s (that is, <= %s), "+
			"so that one late heartbeat does not end the membership", c.HeartbeatInterval, c.SessionTimeout, c.SessionTimeout/3))
	}
	return errs
}

// Validate reports what NewSubscriber would refuse in c, every problem at once. It
// checks c.WithDefaults(), so a config that sets only Brokers (and GroupID, to
// join a group) passes.
func (c SubscriberConfig) Validate() error {
	c = c.WithDefaults()
	errs := []error{brokersError(c.Brokers)}
	if c.Topic != "" || len(c.GroupTopics) > 0 || c.Partition != 0 {
		errs = append(errs, errcode.InvalidConfig("Topic, GroupTopics and Partition must be empty: the topic comes from Subscribe"))
	}
	if c.GroupID != "" && len(c.Partitions) > 0 {
		errs = append(errs, errcode.InvalidConfig("Partitions is only for reading without a GroupID"))
	}
	if c.GroupID != "" && c.StartOffset != kafka.FirstOffset && c.StartOffset != kafka.LastOffset {
		errs = append(errs, errcode.InvalidConfig("with a GroupID, StartOffset must be kafka.FirstOffset or kafka.LastOffset"))
	}
	if c.StartOffset < kafka.FirstOffset {
		errs = append(errs, errcode.InvalidConfig("StartOffset %d is not an offset", c.StartOffset))
	}
	for _, p := range c.Partitions {
		if p < 0 {
			errs = append(errs, errcode.InvalidConfig("partition %d is negative", p))
		}
	}
	if c.MaxConcurrentPartitions < 0 {
		errs = append(errs, errcode.InvalidConfig("MaxConcurrentPartitions must not be negative"))
	}
	if c.MaxInFlightPerPartition < 0 {
		errs = append(errs, errcode.InvalidConfig("MaxInFlightPerPartition must not be negative"))
	}
	if c.NackBackoff < 0 || c.NackBackoffMax < 0 || c.CommitInterval < 0 || c.MaxWait < 0 ||
		c.HeartbeatInterval < 0 || c.SessionTimeout < 0 || c.RebalanceTimeout < 0 {
		errs = append(errs, errcode.InvalidConfig("durations must not be negative"))
	}
	if c.NackBackoffMax > 0 && c.NackBackoffMax < c.NackBackoff {
		errs = append(errs, errcode.InvalidConfig("NackBackoffMax %s must be at least NackBackoff %s", c.NackBackoffMax, c.NackBackoff))
	}
	if c.GroupID != "" {
		errs = append(errs, c.validateGroupTimings()...)
	}
	if c.TopicPartitions < 1 {
		errs = append(errs, errcode.InvalidConfig("TopicPartitions must be at least 1"))
	}
	return errors.Join(errs...)
}
