package kafka

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/segmentio/kafka-go"
)

var _ message.Publisher = (*Publisher)(nil)

// Publisher publishes Watermill messages as Kafka records through a
// kafka.Writer. The message UUID goes in the UUIDHeader header and each
// metadata entry in a header of its own.
type Publisher struct {
	cfg PublisherConfig

	mu      sync.Mutex
	closed  bool
	current *writer        // the writer new Publish calls use; nil before the first
	retired sync.WaitGroup // closes of writers replaced by a wider one
}

// writer is one kafka.Writer. Unless the config brings its own Transport,
// it has a transport of its own whose metadata requests name topics only;
// a Publish to another topic replaces it with a writer for one more topic.
type writer struct {
	w         *kafka.Writer
	transport *kafka.Transport // nil with the config's Transport
	topics    []string
	users     sync.WaitGroup // Publish calls using w
}

func (w *writer) covers(topic string) bool {
	return w.transport == nil || slices.Contains(w.topics, topic)
}

// NewPublisher returns a Publisher. It does not connect until the first Publish.
func NewPublisher(cfg PublisherConfig) (*Publisher, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	return &Publisher{cfg: cfg}, nil
}

func (p *Publisher) newWriter(topics []string) *writer {
	cfg := p.cfg
	w := &writer{topics: topics}
	transport := cfg.Transport
	if transport == nil {
		w.transport = dialerTransport(cfg.Dialer, cfg.RebalanceInterval, topics)
		w.transport.IdleTimeout = cfg.IdleConnTimeout
		transport = w.transport
	}
	var compression kafka.Compression
	if cfg.CompressionCodec != nil {
		compression = kafka.Compression(cfg.CompressionCodec.Code())
	}
	w.w = &kafka.Writer{
		Addr:                   kafka.TCP(cfg.Brokers...),
		Balancer:               cfg.Balancer,
		MaxAttempts:            cfg.MaxAttempts,
		WriteBackoffMin:        cfg.WriteBackoffMin,
		WriteBackoffMax:        cfg.WriteBackoffMax,
		BatchSize:              cfg.BatchSize,
		BatchBytes:             int64(cfg.BatchBytes),
		BatchTimeout:           cfg.BatchTimeout,
		ReadTimeout:            cfg.ReadTimeout,
		WriteTimeout:           cfg.WriteTimeout,
		RequiredAcks:           kafka.RequiredAcks(cfg.RequiredAcks),
		Async:                  cfg.Async,
		Compression:            compression,
		Logger:                 cfg.WriterConfig.Logger,
		ErrorLogger:            cfg.ErrorLogger,
		Transport:              transport,
		AllowAutoTopicCreation: cfg.AllowAutoTopicCreation,
	}
	if cfg.Async {
		logger := cfg.Logger
		w.w.Completion = func(msgs []kafka.Message, err error) {
			if err != nil {
				logger.Error("Async publish failed", err, watermill.LogFields{"messages": len(msgs)})
			}
		}
	}
	return w
}

// acquire returns the writer for topic, registered as in use.
func (p *Publisher) acquire(topic string) (*writer, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, ErrPublisherClosed
	}
	if p.current == nil {
		p.current = p.newWriter([]string{topic})
	} else if !p.current.covers(topic) {
		old := p.current
		p.current = p.newWriter(append(slices.Clip(old.topics), topic))
		p.retire(old)
	}
	p.current.users.Add(1)
	return p.current, nil
}

// retire closes w once the Publish calls using it are done. Called with p.mu
// held, after w stopped being current, so no call starts using w any more.
func (p *Publisher) retire(w *writer) {
	p.retired.Add(1)
	go func() {
		defer p.retired.Done()
		w.users.Wait()
		if err := w.close(); err != nil {
			p.cfg.Logger.Error("Closing a replaced Kafka writer failed", err, nil)
		}
	}()
}

func (w *writer) close() error {
	err := w.w.Close()
	if w.transport != nil {
		w.transport.CloseIdleConnections()
	}
	return err
}

// Publish writes msgs to topic in one WriteMessages call, so they are
// batched. Unless Async is set it returns after the broker acknowledged every
// record (acks=all by default). While the topic's metadata is not available,
// nothing is written and Publish tries again for up to TopicWait. On a write
// error some records may have been written: publish again with the same
// UUIDs, and the consumer's inbox drops the duplicates.
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	if len(msgs) == 0 {
		p.mu.Lock()
		defer p.mu.Unlock()
		if p.closed {
			return ErrPublisherClosed
		}
		return nil
	}
	if topic == "" {
		return errors.New("kafka: publish: the topic is empty")
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
	w, err := p.acquire(topic)
	if err != nil {
		return err
	}
	defer w.users.Done()
	// The Writer has its own retries and timeouts; a message's context is
	// the handler's and must not cut a write short half way through a batch.
	ctx := context.Background()
	deadline := time.Now().Add(p.cfg.TopicWait)
	for attempt := 1; ; attempt++ {
		err := w.w.WriteMessages(ctx, records...)
		if err == nil {
			return nil
		}
		if !beforeWrite(err) {
			return fmt.Errorf("kafka: publish %d message(s) to %s: %w", len(msgs), topic, err)
		}
		// The Writer looks the topic up in the transport's metadata cache
		// and fails at once, before writing anything, while the topic is
		// not there (created a moment ago: it shows up at the next refresh)
		// or while the transport's first metadata request has failed.
		if time.Now().After(deadline) {
			return fmt.Errorf("kafka: publish %d message(s) to %s: no metadata for the topic after %s, nothing written "+
				"(does the topic exist, and does the broker answer?): %w", len(msgs), topic, p.cfg.TopicWait, err)
		}
		if attempt == 1 {
			p.cfg.Logger.Debug("Waiting for the topic's metadata", watermill.LogFields{"topic": topic, "err": err})
		}
		time.Sleep(topicPoll)
	}
}

// beforeWrite tells whether err came from WriteMessages before any record
// was handed to a partition writer: the topic's metadata. Errors of writes
// come as kafka.WriteErrors; a record too large and a closed writer are not
// worth waiting for.
func beforeWrite(err error) bool {
	var writeErrs kafka.WriteErrors
	var tooLarge kafka.MessageTooLargeError
	return !errors.As(err, &writeErrs) && !errors.As(err, &tooLarge) && !errors.Is(err, io.ErrClosedPipe)
}

// topicPoll is the pause between tries while a topic's metadata is missing.
const topicPoll = 100 * time.Millisecond

// Close waits for the Publish calls in progress, flushes pending writes and
// releases connections. It is safe to call more than once.
func (p *Publisher) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		p.retired.Wait()
		return nil
	}
	p.closed = true
	last := p.current
	p.mu.Unlock()
	var err error
	if last != nil {
		last.users.Wait()
		err = last.close()
	}
	p.retired.Wait()
	return err
}
