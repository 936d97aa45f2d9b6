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
	"github.com/idemkit/idem/internal/tracing"
)

var (
	_ message.Subscriber           = (*Subscriber)(nil)
	_ message.SubscribeInitializer = (*Subscriber)(nil)
)

// fetchRetryDelay is the pause after a failed pull (a lost connection, a
// deleted consumer) before the next one.
const fetchRetryDelay = 500 * time.Millisecond

// Subscriber consumes a durable JetStream pull consumer per topic, with explicit
// acks. The connection belongs to the caller: Close does not close it.
type Subscriber struct {
	nc     *natsgo.Conn
	js     jetstream.JetStream
	cfg    SubscriberConfig
	logger watermill.LoggerAdapter

	closing context.Context // cancelled by Close, under mu
	close   context.CancelFunc
	mu      sync.Mutex     // guards subs.Add against Close
	subs    sync.WaitGroup // one per Subscribe call still running

	acked, nacked, terminated, maxDelivered, hookErrors, pulls, pulled atomic.Uint64
}

// NewSubscriber makes a Subscriber on nc.
func NewSubscriber(nc *natsgo.Conn, cfg SubscriberConfig) (*Subscriber, error) {
	if nc == nil {
		return nil, fmt.Errorf("invalid config: %w", errcode.InvalidConfig("nil connection"))
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	js, err := jetstream.New(nc, jetstream.WithDefaultTimeout(cfg.AckTimeout))
	if err != nil {
		return nil, err
	}
	closing, cancel := context.WithCancel(context.Background())
	return &Subscriber{
		nc:      nc,
		js:      js,
		cfg:     cfg,
		logger:  cfg.Logger.With(watermill.LogFields{"component": "nats.Subscriber", "durable": cfg.Durable}),
		closing: closing,
		close:   cancel,
	}, nil
}

// SubscriberStats counts what the subscriber did with the messages it got.
type SubscriberStats struct {
	Acked      uint64 // acks sent (a failed double ack is not counted)
	Nacked     uint64 // NakWithDelay sent, including on Close
	Terminated uint64 // Term sent because the handler called Term and nacked
	// MaxDelivered counts messages that reached MaxDeliver: last deliveries
	// nacked here, and MAX_DELIVERIES advisories this instance handled.
	MaxDelivered uint64
	// MaxDeliverHookErrors counts OnMaxDeliver calls that returned an error.
	MaxDeliverHookErrors uint64
	// Pulls counts the pull requests sent, and Pulled the messages they
	// brought: Pulled / Pulls is the average batch.
	Pulls, Pulled uint64
}

// Stats returns the counters since NewSubscriber.
func (s *Subscriber) Stats() SubscriberStats {
	return SubscriberStats{
		Acked:                s.acked.Load(),
		Nacked:               s.nacked.Load(),
		Terminated:           s.terminated.Load(),
		MaxDelivered:         s.maxDelivered.Load(),
		MaxDeliverHookErrors: s.hookErrors.Load(),
		Pulls:                s.pulls.Load(),
		Pulled:               s.pulled.Load(),
	}
}

// SubscribeInitialize makes sure topic's stream and consumer exist: it creates
// them when AutoProvision is on, and looks the consumer up otherwise.
func (s *Subscriber) SubscribeInitialize(topic string) error {
	ctx, cancel := context.WithTimeout(s.closing, s.cfg.AckTimeout)
	defer cancel()
	_, err := s.consumer(ctx, topic)
	return err
}

// consumer provisions or looks up topic's consumer, and checks that it is one
// this subscriber can drive.
func (s *Subscriber) consumer(ctx context.Context, topic string) (jetstream.Consumer, error) {
	stream, name := s.cfg.StreamName(topic), s.cfg.ConsumerName(topic)
	if err := validName("stream name", stream); err != nil {
		return nil, err
	}
	if err := validName("consumer name", name); err != nil {
		return nil, err
	}
	var c jetstream.Consumer
	var err error
	if s.cfg.AutoProvision {
		if err := ensureStream(ctx, s.js, s.cfg.Topology.streamConfig(topic), s.logger); err != nil {
			return nil, err
		}
		cc := s.cfg.Consumer
		cc.Durable = name
		cc.FilterSubject = s.cfg.Subject(topic)
		c, err = ensureConsumer(ctx, s.js, stream, cc)
	} else {
		c, err = s.js.Consumer(ctx, stream, name)
		if err != nil {
			err = fmt.Errorf("look up consumer %s on stream %s (AutoProvision is off): %w", name, stream, err)
		}
	}
	if err != nil {
		return nil, err
	}
	if p := c.CachedInfo().Config.AckPolicy; p != jetstream.AckExplicitPolicy {
		return nil, fmt.Errorf("consumer %s on stream %s has ack policy %s; it must be explicit", name, stream, p)
	}
	return c, nil
}

// Subscribe delivers topic's messages from its durable consumer. The channel is
// closed when ctx is done or the Subscriber is closed; messages still held then
// are nacked without delay, so another subscriber gets them at once.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	s.mu.Lock()
	if s.closing.Err() != nil {
		s.mu.Unlock()
		return nil, ErrClosed
	}
	s.subs.Add(1)
	s.mu.Unlock()

	sub, err := s.newSubscription(ctx, topic)
	if err != nil {
		s.subs.Done()
		return nil, err
	}
	go sub.run()
	return sub.out, nil
}

// Close stops every subscription, nacks the messages they hold, and waits for
// them to finish. It does not close the connection.
func (s *Subscriber) Close() error {
	s.mu.Lock()
	if s.closing.Err() != nil {
		s.mu.Unlock()
		return nil
	}
	s.close()
	s.mu.Unlock()
	s.subs.Wait()
	return nil
}

// subscription is one Subscribe call: a pull loop, a goroutine per message it
// holds, and a listener for MAX_DELIVERIES advisories.
type subscription struct {
	s        *Subscriber
	topic    string
	cons     jetstream.Consumer
	stream   string
	consumer string
	ctx      context.Context // done on Subscribe's ctx or Close
	cancel   context.CancelFunc
	out      chan *message.Message

	slots        chan struct{} // one per message held
	fetchAtLeast int           // free slots a pull waits for
	handlers     sync.WaitGroup

	failing       bool   // the last pull failed; owned by run
	maxDeliver    uint64 // 0: unlimited
	progressEvery time.Duration

	advisories chan *natsgo.Msg
	advSub     *natsgo.Subscription
}

func (s *Subscriber) newSubscription(ctx context.Context, topic string) (*subscription, error) {
	ctx, cancel := context.WithCancel(ctx)
	stopAfter := context.AfterFunc(s.closing, cancel)
	cancelBoth := func() {
		stopAfter()
		cancel()
	}

	setupCtx, setupCancel := context.WithTimeout(ctx, s.cfg.AckTimeout)
	defer setupCancel()
	cons, err := s.consumer(setupCtx, topic)
	if err != nil {
		cancelBoth()
		return nil, err
	}
	info := cons.CachedInfo()
	sub := &subscription{
		s:            s,
		topic:        topic,
		cons:         cons,
		stream:       info.Stream,
		consumer:     info.Name,
		ctx:          ctx,
		cancel:       cancelBoth,
		out:          make(chan *message.Message),
		slots:        make(chan struct{}, s.cfg.Concurrency),
		fetchAtLeast: min(s.cfg.FetchBatch, s.cfg.Concurrency),
		advisories:   make(chan *natsgo.Msg, 64),
	}
	if info.Config.MaxDeliver > 0 {
		sub.maxDeliver = uint64(info.Config.MaxDeliver)
	}
	// The server's AckWait is the one that counts; with a BackOff, a step may
	// be shorter than it.
	shortest := info.Config.AckWait
	for _, b := range info.Config.BackOff {
		shortest = min(shortest, b)
	}
	sub.progressEvery = s.cfg.ProgressInterval
	if sub.progressEvery == 0 || sub.progressEvery >= shortest {
		sub.progressEvery = max(shortest/3, 10*time.Millisecond)
	}

	// A queue group, so that one instance of the durable handles each advisory.
	subj := fmt.Sprintf("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.%s.%s", sub.stream, sub.consumer)
	sub.advSub, err = s.nc.ChanQueueSubscribe(subj, "idem_max_deliveries", sub.advisories)
	if err != nil {
		cancelBoth()
		return nil, fmt.Errorf("subscribe to %s: %w", subj, err)
	}
	return sub, nil
}

func (sub *subscription) logFields() watermill.LogFields {
	return watermill.LogFields{"topic": sub.topic, "stream": sub.stream, "consumer": sub.consumer}
}

// run pulls messages while there is room for them, and hands each to its own
// goroutine. It asks for no more messages than free slots, so every message it
// gets is in a handler's hands, or on its way there, with InProgress running.
func (sub *subscription) run() {
	defer sub.s.subs.Done()
	defer close(sub.out)
	defer sub.handlers.Wait()
	defer sub.cancel()

	sub.handlers.Add(1)
	go sub.watchAdvisories()

	for {
		n := sub.acquire()
		if n == 0 {
			return
		}
		// A pull is never cancelled, on Close either: it runs out (PullExpiry
		// at most), and whatever it brings after Close is nacked below. A
		// cancelled pull leaves its request on the server, which can still send
		// a message into it (nats-server 2.9 always does, later versions in a
		// race with the unsubscribe), and that message waits out its AckWait.
		// No FetchContext either: its deadline ends the client side only just
		// after the server's expiry, and drops what is still queued then.
		sub.s.pulls.Add(1)
		batch, err := sub.cons.Fetch(n, jetstream.FetchMaxWait(sub.s.cfg.PullExpiry))
		if err != nil {
			sub.release(n)
			if sub.ctx.Err() != nil {
				return
			}
			sub.pullFailed("Pull failed", err)
			continue
		}
		got := 0
		// A message that arrived as Close began is released at once.
		for jm := range batch.Messages() {
			got++
			if sub.ctx.Err() != nil {
				sub.nakNow(jm)
				sub.release(1)
				continue
			}
			sub.handlers.Add(1)
			go sub.handle(jm)
		}
		sub.release(n - got)
		sub.s.pulled.Add(uint64(got))
		if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) &&
			!errors.Is(err, natsgo.ErrTimeout) {
			sub.pullFailed("Pull ended with an error", err)
			continue
		}
		if sub.failing {
			sub.s.logger.Info("Pulling again", sub.logFields())
			sub.failing = false
		}
	}
}

// acquire blocks until at least min(FetchBatch, Concurrency) slots are free
// and takes every free slot. It returns 0 when the subscription is done.
func (sub *subscription) acquire() int {
	n := 0
	for n < sub.fetchAtLeast {
		select {
		case sub.slots <- struct{}{}:
			n++
		case <-sub.ctx.Done():
			sub.release(n)
			return 0
		}
	}
	for n < cap(sub.slots) {
		select {
		case sub.slots <- struct{}{}:
			n++
		default:
			return n
		}
	}
	return n
}

func (sub *subscription) release(n int) {
	for range n {
		<-sub.slots
	}
}

// pullFailed logs a failed pull and pauses before the next. During an outage
// the first failure is an error and the rest, until a pull works again, are
// debug lines, so a reconnecting client does not flood the log.
func (sub *subscription) pullFailed(msg string, err error) {
	if sub.failing {
		sub.s.logger.Debug(msg, sub.logFields().Add(watermill.LogFields{"err": err.Error()}))
	} else {
		sub.s.logger.Error(msg+"; retrying", err, sub.logFields())
	}
	sub.failing = true
	sub.pause()
}

func (sub *subscription) pause() {
	select {
	case <-time.After(fetchRetryDelay):
	case <-sub.ctx.Done():
	}
}

// handle delivers one message and settles it with the server.
func (sub *subscription) handle(jm jetstream.Msg) {
	defer sub.handlers.Done()
	defer sub.release(1)

	md, err := jm.Metadata()
	if err != nil {
		// Not a JetStream delivery: nothing to settle, and nothing to redeliver.
		sub.s.logger.Error("Message without JetStream metadata", err, sub.logFields())
		return
	}
	msg := fromNatsMsg(jm.Subject(), jm.Headers(), jm.Data())
	setDeliveryMetadata(msg, md)
	ctx, term := withTermFlag(sub.s.cfg.Propagator.Extract(sub.ctx, tracing.Metadata(msg.Metadata)))
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	msg.SetContext(ctx)

	stopProgress := sub.keepInProgress(jm)

	select {
	case sub.out <- msg:
	case <-sub.ctx.Done():
		stopProgress()
		sub.nakNow(jm)
		return
	}

	select {
	case <-msg.Acked():
		stopProgress()
		sub.ack(jm, msg, md)
	case <-msg.Nacked():
		stopProgress()
		sub.nack(jm, msg, md, term.Load())
	case <-sub.ctx.Done():
		stopProgress()
		// An ack or nack may have raced with Close; it wins.
		select {
		case <-msg.Acked():
			sub.ack(jm, msg, md)
		case <-msg.Nacked():
			sub.nack(jm, msg, md, term.Load())
		default:
			sub.nakNow(jm)
		}
	}
}

// keepInProgress sends InProgress every progressEvery until stopped, so that a
// handler may run longer than AckWait without a redelivery behind its back.
func (sub *subscription) keepInProgress(jm jetstream.Msg) (stop func()) {
	done := make(chan struct{})
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		t := time.NewTicker(sub.progressEvery)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				if err := jm.InProgress(); err != nil {
					sub.s.logger.Debug("InProgress failed", sub.logFields().Add(watermill.LogFields{"err": err.Error()}))
				}
			case <-done:
				return
			}
		}
	}()
	var once sync.Once
	return func() {
		once.Do(func() {
			close(done)
			<-finished
		})
	}
}

func (sub *subscription) ack(jm jetstream.Msg, msg *message.Message, md *jetstream.MsgMetadata) {
	var err error
	if sub.s.cfg.AckSync {
		ctx, cancel := context.WithTimeout(context.Background(), sub.s.cfg.AckTimeout)
		err = jm.DoubleAck(ctx)
		cancel()
	} else {
		err = jm.Ack()
	}
	if err != nil {
		sub.s.logger.Error("Ack failed; the message will be redelivered after AckWait", err,
			sub.msgFields(msg, md))
		return
	}
	sub.s.acked.Add(1)
}

func (sub *subscription) nack(jm jetstream.Msg, msg *message.Message, md *jetstream.MsgMetadata, term bool) {
	if term {
		if err := jm.Term(); err != nil {
			sub.s.logger.Error("Term failed; the message will be redelivered after AckWait", err, sub.msgFields(msg, md))
			return
		}
		sub.s.terminated.Add(1)
		sub.s.logger.Info("Message terminated", sub.msgFields(msg, md))
		return
	}
	if sub.maxDeliver > 0 && md.NumDelivered >= sub.maxDeliver {
		sub.lastDeliveryFailed(jm, msg, md)
		return
	}
	delay := sub.s.cfg.NakDelay(md.NumDelivered)
	var err error
	if delay > 0 {
		err = jm.NakWithDelay(delay)
	} else {
		err = jm.Nak()
	}
	if err != nil {
		sub.s.logger.Error("Nak failed; the message will be redelivered after AckWait", err, sub.msgFields(msg, md))
		return
	}
	sub.s.nacked.Add(1)
}

// nakNow releases a message this subscription will not handle.
func (sub *subscription) nakNow(jm jetstream.Msg) {
	if err := jm.Nak(); err != nil {
		sub.s.logger.Debug("Nak on close failed; the message will be redelivered after AckWait", sub.logFields().Add(watermill.LogFields{"err": err.Error()}))
		return
	}
	sub.s.nacked.Add(1)
}

func (sub *subscription) msgFields(msg *message.Message, md *jetstream.MsgMetadata) watermill.LogFields {
	return sub.logFields().Add(watermill.LogFields{
		"uuid":          msg.UUID,
		"stream_seq":    md.Sequence.Stream,
		"num_delivered": md.NumDelivered,
	})
}

// lastDeliveryFailed handles a nack on the delivery that reached MaxDeliver.
// The server would not deliver the message again, so it is logged, counted and
// handed to OnMaxDeliver here, then terminated, which keeps the server from
// raising a MAX_DELIVERIES advisory for it as well.
func (sub *subscription) lastDeliveryFailed(jm jetstream.Msg, msg *message.Message, md *jetstream.MsgMetadata) {
	sub.maxDeliveredFound(MaxDelivered{
		Message:    msg.Copy(),
		Stream:     md.Stream,
		Consumer:   md.Consumer,
		StreamSeq:  md.Sequence.Stream,
		Deliveries: md.NumDelivered,
		Source:     MaxDeliveredByNack,
	})
	if err := jm.Term(); err != nil {
		sub.s.logger.Error("Term after MaxDeliver failed; the server will raise a MAX_DELIVERIES advisory", err, sub.msgFields(msg, md))
	}
}
