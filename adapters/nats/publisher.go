package nats

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/internal/errcode"
)

var (
	// ErrClosed is returned by Publish and Subscribe after Close.
	ErrClosed = errors.New("nats: closed")

	// ErrInvalidConfig is wrapped by the error NewPublisher or NewSubscriber
	// returns for a config it refuses (code "invalid_config"). Every idem package
	// has the same value.
	ErrInvalidConfig = errcode.ErrInvalidConfig
)

var _ message.Publisher = (*Publisher)(nil)

// Publisher publishes Watermill messages to JetStream. Each message's UUID is
// its Nats-Msg-Id. The connection belongs to the caller: Close does not close it.
type Publisher struct {
	js     jetstream.JetStream
	cfg    PublisherConfig
	logger watermill.LoggerAdapter

	slots   chan struct{} // one per message waiting for its ack
	pending sync.WaitGroup
	streams sync.Map // stream name -> struct{}, provisioned already

	mu     sync.RWMutex // held for reading while publishing, for writing to close
	closed bool

	asyncFailed atomic.Uint64
}

// NewPublisher makes a Publisher on nc.
func NewPublisher(nc *natsgo.Conn, cfg PublisherConfig) (*Publisher, error) {
	if nc == nil {
		return nil, fmt.Errorf("invalid config: %w", errcode.InvalidConfig("nil connection"))
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	// The client's own bound sits above ours, so it never stalls: our semaphore
	// blocks first, and blocks without a timeout of its own.
	js, err := jetstream.New(nc,
		jetstream.WithPublishAsyncMaxPending(2*cfg.MaxInFlight),
		jetstream.WithPublishAsyncTimeout(cfg.PublishTimeout),
	)
	if err != nil {
		return nil, err
	}
	return &Publisher{
		js:     js,
		cfg:    cfg,
		logger: cfg.Logger.With(watermill.LogFields{"component": "nats.Publisher"}),
		slots:  make(chan struct{}, cfg.MaxInFlight),
	}, nil
}

// Publish stores msgs on topic's subject. In sync mode (the default) it returns
// when the stream has stored every message, or with the errors of those it did
// not; publishing the same messages again is safe within the duplicate window.
// The messages are pipelined, at most MaxInFlight at a time. In async mode it
// returns once the messages are sent, see PublisherConfig.Async.
//
// The context of the first message bounds the call, with PublishTimeout.
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.RLock()
	defer p.mu.RUnlock()
	if p.closed {
		return ErrClosed
	}
	if len(msgs) == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(msgs[0].Context(), p.cfg.PublishTimeout)
	defer cancel()

	if err := p.provision(ctx, topic); err != nil {
		return err
	}
	subject := p.cfg.Subject(topic)

	if !p.cfg.Async && len(msgs) == 1 {
		ack, err := p.js.PublishMsg(ctx, toNatsMsg(subject, msgs[0], p.cfg.Propagator))
		if err != nil {
			return fmt.Errorf("publish %s to %s: %w", msgs[0].UUID, subject, err)
		}
		p.logPublished(topic, msgs[0], ack)
		return nil
	}

	// Every message takes a slot until its ack (or error) arrives, whichever
	// Publish call sent it, so concurrent batches share the bound and never
	// wait on each other's slots.
	results := make(chan error, len(msgs))
	sent := 0
	var errs []error
	for _, msg := range msgs {
		select {
		case p.slots <- struct{}{}:
		case <-ctx.Done():
			errs = append(errs, fmt.Errorf("publish %s to %s: %w", msg.UUID, subject, ctx.Err()))
			continue
		}
		f, err := p.js.PublishMsgAsync(toNatsMsg(subject, msg, p.cfg.Propagator))
		if err != nil {
			<-p.slots
			errs = append(errs, fmt.Errorf("publish %s to %s: %w", msg.UUID, subject, err))
			continue
		}
		p.pending.Add(1)
		sent++
		go p.awaitAck(topic, msg, f, results)
	}
	if p.cfg.Async {
		return errors.Join(errs...)
	}
	for range sent {
		select {
		case err := <-results:
			if err != nil {
				errs = append(errs, fmt.Errorf("publish to %s: %w", subject, err))
			}
		case <-ctx.Done():
			return errors.Join(append(errs, fmt.Errorf("publish to %s: %w", subject, ctx.Err()))...)
		}
	}
	return errors.Join(errs...)
}

// awaitAck waits for one pipelined publish's ack and frees its slot. The
// client times the ack out after PublishTimeout, so this always ends. In sync
// mode the result goes to the waiting Publish call; in async mode a failure is
// logged, counted and handed to OnAsyncError.
func (p *Publisher) awaitAck(topic string, msg *message.Message, f jetstream.PubAckFuture, results chan<- error) {
	defer p.pending.Done()
	var err error
	select {
	case ack := <-f.Ok():
		p.logPublished(topic, msg, ack)
	case err = <-f.Err():
		err = fmt.Errorf("message %s: %w", msg.UUID, err)
	}
	<-p.slots
	if !p.cfg.Async {
		results <- err
		return
	}
	if err != nil {
		p.asyncFailed.Add(1)
		p.logger.Error("Async publish not acked", err, watermill.LogFields{"topic": topic, "uuid": msg.UUID})
		if p.cfg.OnAsyncError != nil {
			p.cfg.OnAsyncError(topic, msg, err)
		}
	}
}

func (p *Publisher) logPublished(topic string, msg *message.Message, ack *jetstream.PubAck) {
	p.logger.Trace("Published", watermill.LogFields{"topic": topic, "uuid": msg.UUID, "stream": ack.Stream, "seq": ack.Sequence, "duplicate": ack.Duplicate})
}

// provision creates topic's stream once per Publisher when AutoProvision is on.
func (p *Publisher) provision(ctx context.Context, topic string) error {
	if !p.cfg.AutoProvision {
		return nil
	}
	name := p.cfg.StreamName(topic)
	if _, ok := p.streams.Load(name); ok {
		return nil
	}
	if err := ensureStream(ctx, p.js, p.cfg.Topology.streamConfig(topic), p.logger); err != nil {
		return err
	}
	p.streams.Store(name, struct{}{})
	return nil
}

// AsyncFailures is the number of async publishes whose ack never came.
func (p *Publisher) AsyncFailures() uint64 { return p.asyncFailed.Load() }

// Close stops new publishes and waits, up to CloseTimeout, for the acks of
// async publishes still pending. It does not close the connection.
func (p *Publisher) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	p.mu.Unlock()

	done := make(chan struct{})
	go func() {
		p.pending.Wait()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-time.After(p.cfg.CloseTimeout):
		return fmt.Errorf("nats: close: %d async publishes still wait for an ack after %s", len(p.slots), p.cfg.CloseTimeout)
	}
}
