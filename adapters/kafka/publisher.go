package kafka

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/segmentio/kafka-go"
)

var _ message.Publisher = (*Publisher)(nil)

// ErrPublisherClosed is returned by Publish after Close.
var ErrPublisherClosed = errors.New("kafka: publisher closed")

// Publisher publishes Watermill messages as Kafka records through one
// kafka.Writer. The message UUID goes in the UUIDHeader header and each
// metadata entry in a header of its own.
type Publisher struct {
	cfg       PublisherConfig
	writer    *kafka.Writer
	transport *kafka.Transport // non-nil when we made it and must close it

	mu     sync.RWMutex
	closed bool
}

// NewPublisher returns a Publisher. It does not connect until the first Publish.
func NewPublisher(cfg PublisherConfig) (*Publisher, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	p := &Publisher{cfg: cfg}
	transport := cfg.Transport
	if transport == nil {
		p.transport = &kafka.Transport{MetadataTTL: DefaultMetadataTTL}
		transport = p.transport
	}
	p.writer = &kafka.Writer{
		Addr:                   kafka.TCP(cfg.Brokers...),
		Balancer:               cfg.Balancer,
		MaxAttempts:            cfg.MaxAttempts,
		WriteBackoffMin:        cfg.WriteBackoffMin,
		WriteBackoffMax:        cfg.WriteBackoffMax,
		BatchSize:              cfg.BatchSize,
		BatchBytes:             cfg.BatchBytes,
		BatchTimeout:           cfg.BatchTimeout,
		ReadTimeout:            cfg.ReadTimeout,
		WriteTimeout:           cfg.WriteTimeout,
		RequiredAcks:           cfg.RequiredAcks,
		Async:                  cfg.Async,
		Compression:            cfg.Compression,
		Transport:              transport,
		AllowAutoTopicCreation: cfg.AllowAutoTopicCreation,
	}
	if cfg.Async {
		logger := cfg.Logger
		p.writer.Completion = func(msgs []kafka.Message, err error) {
			if err != nil {
				logger.Error("Async publish failed", err, watermill.LogFields{"messages": len(msgs)})
			}
		}
	}
	return p, nil
}

// Publish writes msgs to topic in one WriteMessages call, so they are
// batched. Unless Async is set it returns after the broker acknowledged every
// record (acks=all by default). On error some records may have been written:
// publish again with the same UUIDs, and the consumer's inbox drops the
// duplicates.
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.RLock()
	defer p.mu.RUnlock()
	if p.closed {
		return ErrPublisherClosed
	}
	if len(msgs) == 0 {
		return nil
	}
	records := make([]kafka.Message, len(msgs))
	for i, msg := range msgs {
		var key []byte
		if p.cfg.PartitionKey != nil {
			k, err := p.cfg.PartitionKey(topic, msg)
			if err != nil {
				return fmt.Errorf("kafka: partition key of message %s: %w", msg.UUID, err)
			}
			key = k
		}
		records[i] = toRecord(topic, key, msg, p.cfg.Propagator)
	}
	// The Writer has its own retries and timeouts; a message's context is
	// the handler's and must not cut a write short half way through a batch.
	ctx := context.Background()
	deadline := time.Now().Add(unknownTopicWait)
	for {
		err := p.writer.WriteMessages(ctx, records...)
		// The Writer looks topics up in the transport's metadata cache and
		// fails at once, before writing anything, if the topic is not there.
		// A topic created a moment ago shows up at the next refresh.
		if errors.Is(err, kafka.UnknownTopicOrPartition) && time.Now().Before(deadline) {
			time.Sleep(unknownTopicPoll)
			continue
		}
		if err != nil {
			return fmt.Errorf("kafka: publish %d message(s) to %s: %w", len(msgs), topic, err)
		}
		return nil
	}
}

// A publish to a topic missing from the metadata cache is retried for this
// long: a few refreshes of the default transport.
const (
	unknownTopicWait = 3 * DefaultMetadataTTL
	unknownTopicPoll = 100 * time.Millisecond
)

// Close flushes pending writes and releases connections. It is safe to call
// more than once.
func (p *Publisher) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	p.closed = true
	err := p.writer.Close()
	if p.transport != nil {
		p.transport.CloseIdleConnections()
	}
	return err
}
