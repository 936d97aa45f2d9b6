package chaos

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/idem/internal/errcode"
)

// eventKind names what happened to a delivery.
type eventKind string

// Event kinds.
const (
	// eventOriginal: the message as the upstream subscriber delivered it. Its ack
	// or nack goes upstream.
	eventOriginal eventKind = "original"
	// eventDuplicate: an extra copy, injected next to the original.
	eventDuplicate eventKind = "duplicate"
	// eventRedelivery: a copy delivered after the original was acked.
	eventRedelivery eventKind = "redelivery"
	// eventNackRedelivery: an injected copy delivered again after it was nacked.
	eventNackRedelivery eventKind = "nack-redelivery"
)

// event is one delivery by a Subscriber, as the tests' observer sees it.
type event struct {
	Kind eventKind
	// UUID of the message.
	UUID string
	// Seq is the message's position in the upstream order, from 0.
	Seq int64
	// Delay is the injected delay before this delivery.
	Delay time.Duration
}

type kindKey struct{}

// kindOf tells what kind of delivery a message handed on by a Subscriber is, from
// its context (or a context derived from it, such as a handler's). It is for the
// tests; a handler must never behave differently for injected copies.
func kindOf(ctx context.Context) (eventKind, bool) {
	k, ok := ctx.Value(kindKey{}).(eventKind)
	return k, ok
}

// Stats counts what a Subscriber did.
type Stats struct {
	// Received is how many messages the upstream subscriber delivered.
	Received int64
	// Delivered is how many messages were handed on, all kinds together.
	Delivered int64
	// Duplicates is how many extra copies were injected next to originals.
	Duplicates int64
	// Redeliveries is how many copies were delivered after their original was
	// acked.
	Redeliveries int64
	// NackRedeliveries is how many nacked copies were delivered again.
	NackRedeliveries int64
	// Reordered is how many messages the reorder window let go ahead of an
	// earlier one.
	Reordered int64
	// Delayed is how many deliveries were delayed.
	Delayed int64
	// Acked and Nacked count the handler's answers, all kinds together.
	Acked, Nacked int64
	// UpstreamAcked and UpstreamNacked count the answers passed to the upstream
	// subscriber (one per original delivery).
	UpstreamAcked, UpstreamNacked int64
}

// Injected is every delivery beyond one per upstream message: the deliveries that
// a correct consumer must turn into duplicates.
func (s Stats) Injected() int64 { return s.Duplicates + s.Redeliveries + s.NackRedeliveries }

// Subscriber wraps a message.Subscriber and injects the faults of an at-least-once
// broker: duplicates, redelivery of acked messages, reordering and delay. Each
// delivery is its own *message.Message, with the same UUID, and its own copy of the
// payload and metadata. Only the original delivery's ack or nack reaches the
// upstream message, exactly once; the injected copies are the Subscriber's own,
// and a nacked copy is delivered again, as a broker would.
type Subscriber struct {
	up  message.Subscriber
	cfg Config

	closing   chan struct{}
	closeOnce sync.Once
	wg        sync.WaitGroup

	stats struct {
		received, delivered, duplicates, redeliveries, nackRedeliveries,
		reordered, delayed, acked, nacked, upAcked, upNacked atomic.Int64
	}
	// observer, set by tests before Subscribe, is told of every delivery and
	// injected fault, in the order they happen.
	observer func(event)
}

var _ message.Subscriber = (*Subscriber)(nil)

// NewSubscriber wraps up.
func NewSubscriber(up message.Subscriber, cfg Config) (*Subscriber, error) {
	if up == nil {
		return nil, fmt.Errorf("invalid config: %w", errcode.InvalidConfig("nil upstream subscriber"))
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	return &Subscriber{up: up, cfg: cfg, closing: make(chan struct{})}, nil
}

// Decorator returns a message.SubscriberDecorator, for places that take one.
func Decorator(cfg Config) message.SubscriberDecorator {
	return func(sub message.Subscriber) (message.Subscriber, error) { return NewSubscriber(sub, cfg) }
}

// Stats returns the counters so far.
func (s *Subscriber) Stats() Stats {
	st := &s.stats
	return Stats{
		Received: st.received.Load(), Delivered: st.delivered.Load(),
		Duplicates: st.duplicates.Load(), Redeliveries: st.redeliveries.Load(),
		NackRedeliveries: st.nackRedeliveries.Load(), Reordered: st.reordered.Load(),
		Delayed: st.delayed.Load(), Acked: st.acked.Load(), Nacked: st.nacked.Load(),
		UpstreamAcked: st.upAcked.Load(), UpstreamNacked: st.upNacked.Load(),
	}
}

// Close stops every subscription, closes the upstream subscriber and waits for the
// Subscriber's goroutines. Originals not yet answered are left unanswered
// upstream, as after a crash; pending injected copies are dropped.
func (s *Subscriber) Close() error {
	var err error
	s.closeOnce.Do(func() {
		close(s.closing)
		err = s.up.Close()
		s.wg.Wait()
	})
	return err
}

// Subscribe subscribes upstream and returns the chaotic stream.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	select {
	case <-s.closing:
		return nil, errors.New("chaos: subscriber closed")
	default:
	}
	in, err := s.up.Subscribe(ctx, topic)
	if err != nil {
		return nil, err
	}
	sub := &subscription{
		s: s, ctx: ctx, in: in,
		out:  make(chan *message.Message),
		wake: make(chan struct{}, 1),
		done: make(chan struct{}),
	}
	s.wg.Add(2)
	go sub.read()
	go sub.send()
	return sub.out, nil
}

// subscription is one Subscribe call: a reader of the upstream channel, a reorder
// window, a schedule of deliveries, and a sender to the output channel.
type subscription struct {
	s   *Subscriber
	ctx context.Context
	in  <-chan *message.Message
	out chan *message.Message

	mu    sync.Mutex
	queue deliveryHeap
	seq   int64 // tie-break in the schedule, so equal due times keep their order
	wake  chan struct{}

	done     chan struct{} // closed when the reader has stopped for good
	watchers sync.WaitGroup
}

// delivery is one message scheduled for the output channel.
type delivery struct {
	due  time.Time // zero: at once
	seq  int64
	kind eventKind
	n    int64 // upstream position
	up   *message.Message
	// redeliver: after the original is acked, deliver it again.
	redeliver bool
	delay     time.Duration
}

type deliveryHeap []*delivery

func (h deliveryHeap) Len() int { return len(h) }
func (h deliveryHeap) Less(i, j int) bool {
	if !h[i].due.Equal(h[j].due) {
		return h[i].due.Before(h[j].due)
	}
	return h[i].seq < h[j].seq
}
func (h deliveryHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *deliveryHeap) Push(x any)   { *h = append(*h, x.(*delivery)) }
func (h *deliveryHeap) Pop() any {
	old := *h
	d := old[len(old)-1]
	*h = old[:len(old)-1]
	return d
}

// rng returns the generator for the n-th upstream message.
func (s *Subscriber) rng(n int64, stream uint64) *rand.Rand {
	return rand.New(rand.NewPCG(uint64(s.cfg.Seed), uint64(n)<<8|stream))
}

// Streams of the per-message generators.
const (
	streamFaults  = 1
	streamReorder = 2
)

func (s *Subscriber) delay(r *rand.Rand) time.Duration {
	if s.cfg.MaxDelay <= 0 {
		return 0
	}
	return time.Duration(r.Int64N(int64(s.cfg.MaxDelay)))
}

// read takes upstream messages in order, decides their faults, passes them through
// the reorder window and schedules them.
func (sub *subscription) read() {
	defer sub.s.wg.Done()
	defer close(sub.done)
	s := sub.s
	var (
		n      int64
		window []*delivery // held by the reorder window, in upstream order
		idle   *time.Timer
		idleC  <-chan time.Time
	)
	release := func(i int) {
		if i > 0 {
			s.stats.reordered.Add(1)
		}
		d := window[i]
		window = slices.Delete(window, i, i+1)
		sub.schedule(d)
	}
	defer func() {
		if idle != nil {
			idle.Stop()
		}
		// Held originals never reached the handler: give them back upstream.
		for _, d := range window {
			d.up.Nack()
			s.stats.upNacked.Add(1)
		}
	}()
	for {
		select {
		case <-s.closing:
			return
		case <-sub.ctx.Done():
			return
		case <-idleC:
			idleC = nil
			// Nothing more came: let the held messages go, shuffled.
			for len(window) > 0 {
				r := s.rng(window[0].n, streamReorder)
				release(r.IntN(len(window)))
			}
		case up, ok := <-sub.in:
			if !ok {
				for len(window) > 0 {
					release(0)
				}
				return
			}
			s.stats.received.Add(1)
			r := s.rng(n, streamFaults)
			d := &delivery{kind: eventOriginal, n: n, up: up, delay: s.delay(r)}
			copies := 0
			if r.Float64() < s.cfg.DuplicateProbability {
				copies = 1 + r.IntN(s.cfg.MaxCopies)
			}
			d.redeliver = r.Float64() < s.cfg.RedeliverProbability
			n++
			if s.cfg.ReorderWindow <= 1 {
				sub.schedule(d)
			} else {
				window = append(window, d)
				if len(window) >= s.cfg.ReorderWindow {
					release(s.rng(d.n, streamReorder).IntN(len(window)))
				}
				if idle == nil {
					idle = time.NewTimer(s.cfg.ReorderIdle)
				} else {
					idle.Reset(s.cfg.ReorderIdle)
				}
				idleC = idle.C
			}
			for range copies {
				s.stats.duplicates.Add(1)
				sub.schedule(&delivery{kind: eventDuplicate, n: d.n, up: up, delay: s.delay(r)})
			}
		}
	}
}

// schedule puts d in the schedule, due after its delay.
func (sub *subscription) schedule(d *delivery) {
	if d.delay > 0 {
		d.due = time.Now().Add(d.delay)
	}
	sub.mu.Lock()
	sub.seq++
	d.seq = sub.seq
	heap.Push(&sub.queue, d)
	sub.mu.Unlock()
	select {
	case sub.wake <- struct{}{}:
	default:
	}
}

// scheduleAfter schedules a copy of d of the given kind after delay.
func (sub *subscription) scheduleAfter(d *delivery, kind eventKind, delay time.Duration) {
	sub.schedule(&delivery{kind: kind, n: d.n, up: d.up, delay: delay})
}

// send hands due deliveries to the output channel, one at a time, and closes it
// when the subscription ends.
func (sub *subscription) send() {
	s := sub.s
	defer s.wg.Done()
	defer close(sub.out)
	defer sub.watchers.Wait()
	defer sub.drop()
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	readerDone := sub.done
	for {
		sub.mu.Lock()
		var next *delivery
		var wait time.Duration
		if len(sub.queue) > 0 {
			next = sub.queue[0]
			if !next.due.IsZero() {
				wait = time.Until(next.due)
			}
			if wait <= 0 {
				heap.Pop(&sub.queue)
			}
		}
		sub.mu.Unlock()

		if next != nil && wait <= 0 {
			if !sub.deliver(next) {
				return
			}
			continue
		}
		var timerC <-chan time.Time
		if next != nil {
			timer.Reset(wait)
			timerC = timer.C
		}
		select {
		case <-s.closing:
			return
		case <-sub.ctx.Done():
			return
		case <-readerDone:
			// The upstream channel ended: the subscription is over. Pending
			// copies are dropped, as a broker's would be when the consumer leaves.
			return
		case <-sub.wake:
		case <-timerC:
		}
		if !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
	}
}

// deliver sends one delivery and starts watching its answer. It returns false when
// the subscription is over.
func (sub *subscription) deliver(d *delivery) bool {
	s := sub.s
	msg := message.NewMessage(d.up.UUID, slices.Clone(d.up.Payload))
	for k, v := range d.up.Metadata {
		msg.Metadata.Set(k, v)
	}
	var cancel context.CancelFunc = func() {}
	ctx := d.up.Context()
	if d.kind != eventOriginal {
		// The upstream message's context may be cancelled once it is acked (the
		// GoChannel does that), and a copy outlives it.
		ctx, cancel = context.WithCancel(context.WithoutCancel(ctx))
	}
	msg.SetContext(context.WithValue(ctx, kindKey{}, d.kind))
	select {
	case sub.out <- msg:
	case <-s.closing:
		cancel()
		sub.giveBack(d)
		return false
	case <-sub.ctx.Done():
		cancel()
		sub.giveBack(d)
		return false
	}
	s.stats.delivered.Add(1)
	if d.delay > 0 {
		s.stats.delayed.Add(1)
	}
	switch d.kind {
	case eventRedelivery:
		s.stats.redeliveries.Add(1)
	case eventNackRedelivery:
		s.stats.nackRedeliveries.Add(1)
	}
	if s.observer != nil {
		s.observer(event{Kind: d.kind, UUID: d.up.UUID, Seq: d.n, Delay: d.delay})
	}
	if d.kind != eventOriginal {
		s.cfg.Logger.Debug("chaos: injected delivery", "kind", string(d.kind), "uuid", d.up.UUID, "seq", d.n, "delay", d.delay)
	}
	sub.watchers.Add(1)
	go sub.watch(d, msg, cancel)
	return true
}

// drop empties the schedule when the subscription ends: originals go back upstream
// with a nack, injected copies are forgotten.
func (sub *subscription) drop() {
	sub.mu.Lock()
	q := sub.queue
	sub.queue = nil
	sub.mu.Unlock()
	for _, d := range q {
		sub.giveBack(d)
	}
}

// giveBack nacks an original that could not be delivered.
func (sub *subscription) giveBack(d *delivery) {
	if d.kind == eventOriginal {
		d.up.Nack()
		sub.s.stats.upNacked.Add(1)
	}
}

// watch waits for the handler's answer to one delivery.
func (sub *subscription) watch(d *delivery, msg *message.Message, cancel context.CancelFunc) {
	defer sub.watchers.Done()
	defer cancel()
	s := sub.s
	var acked, nacked bool
	select {
	case <-msg.Acked():
		acked = true
	case <-msg.Nacked():
		nacked = true
	case <-s.closing:
	case <-sub.ctx.Done():
	}
	if !acked && !nacked {
		// Closing: an answer given just before still counts.
		select {
		case <-msg.Acked():
			acked = true
		case <-msg.Nacked():
			nacked = true
		default:
			return
		}
	}
	switch {
	case acked:
		s.stats.acked.Add(1)
		if d.kind != eventOriginal {
			return
		}
		d.up.Ack()
		s.stats.upAcked.Add(1)
		if d.redeliver {
			sub.scheduleAfter(d, eventRedelivery, s.cfg.RedeliverDelay)
		}
	case nacked:
		s.stats.nacked.Add(1)
		if d.kind == eventOriginal {
			// The upstream subscriber redelivers it; a later delivery gets the
			// same redelivery decision again from its new position.
			d.up.Nack()
			s.stats.upNacked.Add(1)
			return
		}
		sub.scheduleAfter(d, eventNackRedelivery, s.cfg.NackDelay)
	}
}
