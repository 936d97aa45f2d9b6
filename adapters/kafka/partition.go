package kafka

import (
	"cmp"
	"container/heap"
	"context"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/idem/internal/tracing"
)

// partitionRun delivers one partition's records for one generation (or one
// groupless Subscribe call). Its state belongs to the run goroutine alone;
// the fetch goroutine and the goroutines waiting on each delivery talk to it
// through channels.
//
// The rules, with N = MaxInFlightPerPartition:
//
//   - At most N records are unacked at once: in a handler, or nacked and
//     waiting for their redelivery. With N = 1 that is partition order, one
//     record at a time, and a nacked record holds the partition.
//   - A record is delivered only when every earlier record of its partition
//     with the same key is acked (records without a key share one key, unless
//     UnorderedWithoutKey). Of the records that may go, the lowest offset goes
//     first.
//   - The committed offset is the end of the window's settled prefix: never
//     past a record that is not acked.
type partitionRun struct {
	sub       *subscription
	tp        topicPartition
	maxUnack  int
	windowCap int
	onAck     func(partition int, next int64)
	held      *heldGauge // the partition's held metrics

	window   []*entry            // offset order, from the commit point on
	byKey    map[string][]*entry // unacked records of each key, offset order
	ready    readyHeap           // records never delivered that may go now
	retries  readyHeap           // nacked records whose NackBackoff is over
	unacked  int                 // records inHandler or backingOff
	handling int                 // records inHandler
	reserved bool                // holds a slot for the next delivery

	events    chan settlement
	reporters int // goroutines that will send one settlement each, or none once ctx ends
	waiters   sync.WaitGroup
}

// consumePartition delivers one partition's records from offset until ctx
// ends. onAck, if not nil, learns the next offset to commit each time the
// partition's settled prefix grows: after acks, and after runs of records
// that are passed over without being delivered (transaction markers, aborted
// records), which are committed as they are passed, so a partition whose tail
// is a marker shows no lag.
func (sub *subscription) consumePartition(ctx context.Context, partition int, offset int64, onAck func(partition int, next int64)) {
	cfg := sub.s.cfg
	p := &partitionRun{
		sub:       sub,
		tp:        topicPartition{sub.topic, partition},
		maxUnack:  cfg.MaxInFlightPerPartition,
		windowCap: windowPerInFlight * cfg.MaxInFlightPerPartition,
		onAck:     onAck,
		held:      sub.s.metrics.partition(cfg.GroupID, sub.topic, partition),
		byKey:     map[string][]*entry{},
		events:    make(chan settlement),
	}
	// Revoked or closed: the partition is no longer this process's to hold.
	defer p.held.show(false, 0, "")
	if offset >= 0 {
		// Records before the start were committed: by this member, or by the
		// partition's owners since this process last had it.
		sub.deliveries.prune(p.tp, offset)
	}

	steps := make(chan []fetched)
	var fetcher sync.WaitGroup
	fetcher.Add(1)
	go func() {
		defer fetcher.Done()
		sub.fetchPartition(ctx, partition, offset, steps)
	}()
	defer fetcher.Wait()
	defer p.waiters.Wait()
	p.run(ctx, steps)
}

// fetchPartition reads the partition from offset and sends the steps of
// each fetch response to steps, until ctx ends. It reads ahead while the run
// goroutine is busy, by one fetch response.
func (sub *subscription) fetchPartition(ctx context.Context, partition int, offset int64, steps chan<- []fetched) {
	f := newPartitionFetcher(sub.transport, sub.s.cfg.ReaderConfig, sub.topic, partition, offset)
	fields := watermill.LogFields{"partition": partition}
	f.onReset = func(from, to int64, why string) {
		sub.logger.Error("Fetch position moved", nil, fields.Add(watermill.LogFields{
			"from": from, "to": to, "why": why,
		}))
	}
	backoff := sub.s.cfg.ReadBackoffMin
	var failures failureLog
	for {
		got, err := f.take(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			failures.failed(sub.logger, "Fetching failed; retrying", err, fields.Add(watermill.LogFields{"retry_in": backoff}))
			if !sleep(ctx, backoff) {
				return
			}
			backoff = min(2*backoff, sub.s.cfg.ReadBackoffMax)
			continue
		}
		failures.recovered(sub.logger, "Fetching again", fields)
		backoff = sub.s.cfg.ReadBackoffMin
		if len(got) == 0 {
			continue // the fetch brought nothing new
		}
		select {
		case steps <- got:
		case <-ctx.Done():
			return
		}
	}
}

// candidate is the message prepared for the next delivery.
type candidate struct {
	e      *entry
	msg    *message.Message
	count  int
	cancel context.CancelFunc
}

func (p *partitionRun) run(ctx context.Context, steps <-chan []fetched) {
	var (
		next    *candidate // prepared for the next delivery
		watched *candidate // the latest delivery: this loop waits for its ack itself
		pending []fetched  // fetched, not yet in the window
	)
	defer func() {
		for _, c := range []*candidate{next, watched} {
			if c != nil {
				c.cancel()
			}
		}
		// The records still in handlers give their slots back: they are
		// no longer this subscription's.
		for range p.handling {
			<-p.sub.slots
		}
		if p.reserved {
			<-p.sub.slots
		}
	}()
	for {
		if ctx.Err() != nil {
			p.hearAcksGiven(ctx) // see the ctx.Done case below
			return
		}
		for len(pending) > 0 && len(p.window) < p.windowCap {
			p.add(pending[0])
			pending[0] = fetched{}
			pending = pending[1:]
		}
		head := p.pick()
		// Each record in a handler holds one of the subscription's slots,
		// taken before it is sent and given back on its ack or nack, so
		// partitions waiting for room take turns. A slot taken when there
		// is nothing left to send goes back.
		if p.reserved && head == nil {
			<-p.sub.slots
			p.reserved = false
		}
		if next != nil && next.e != head {
			next.cancel()
			next = nil
		}

		var (
			takeSteps       <-chan []fetched
			takeSlot        chan<- struct{}
			send            chan<- *message.Message
			msg             *message.Message
			isAcked, isNack <-chan struct{}
		)
		if len(pending) == 0 && len(p.window) < p.windowCap {
			takeSteps = steps
		}
		if head != nil {
			if !p.reserved {
				takeSlot = p.sub.slots
			} else {
				if next == nil {
					next = p.prepare(ctx, head)
				}
				send, msg = p.sub.out, next.msg
			}
		}
		if watched != nil {
			isAcked, isNack = watched.msg.Acked(), watched.msg.Nacked()
		}
		var events <-chan settlement
		if p.reporters > 0 {
			events = p.events
		}

		// The common case, without the full select: a slot is free, and the
		// handler side is waiting for the next message.
		if takeSlot != nil {
			select {
			case takeSlot <- struct{}{}:
				p.reserved = true
				continue
			default:
			}
		}
		if send != nil {
			select {
			case send <- msg:
				watched, next = p.sent(ctx, watched, next), nil
				continue
			default:
			}
		}

		select {
		case pending = <-takeSteps:
		case takeSlot <- struct{}{}:
			p.reserved = true
		case send <- msg:
			watched, next = p.sent(ctx, watched, next), nil
		case <-isAcked:
			watched.cancel()
			p.settle(ctx, settlement{e: watched.e, outcome: acked})
			watched = nil
		case <-isNack:
			watched.cancel()
			p.settle(ctx, nackOf(watched))
			watched = nil
		case s := <-events:
			p.reporters--
			p.settle(ctx, s)
		case <-ctx.Done():
			// Revoked or closing: the acks already given are heard, so that
			// the final commit covers them; the records still in handlers
			// stay unacked and uncommitted, and an ack that comes later is
			// not heard.
			p.hearAcksGiven(ctx)
			return
		}
	}
}

// pick returns the record to deliver next, or nil: the lowest offset of the
// retries (already unacked, so always allowed) and, while fewer than
// MaxInFlightPerPartition records are unacked, of the ready ones.
func (p *partitionRun) pick() *entry {
	var retry, fresh *entry
	if len(p.retries) > 0 {
		retry = p.retries[0]
	}
	if len(p.ready) > 0 && p.unacked < p.maxUnack {
		fresh = p.ready[0]
	}
	if retry != nil && (fresh == nil || retry.rec.Offset < fresh.rec.Offset) {
		return retry
	}
	return fresh
}

func (p *partitionRun) add(step fetched) {
	e := &entry{rec: step.rec, next: step.next, index: -1}
	p.window = append(p.window, e)
	if step.rec == nil {
		e.state = settled
		p.advance()
		return
	}
	e.key = string(step.rec.Key)
	e.keyed = len(step.rec.Key) > 0 || !p.sub.s.cfg.UnorderedWithoutKey
	if e.keyed {
		q := p.byKey[e.key]
		q = append(q, e)
		p.byKey[e.key] = q
		if len(q) > 1 {
			return // an earlier record of its key is not acked yet
		}
	}
	heap.Push(&p.ready, e)
}

// prepare makes the message for e's next delivery. Its delivery count is
// recorded only once it is sent.
func (p *partitionRun) prepare(ctx context.Context, e *entry) *candidate {
	count := p.sub.deliveries.count(p.tp, e.rec.Offset) + 1
	msg := fromRecord(*e.rec, count)
	mctx, cancel := context.WithCancel(p.sub.s.cfg.Propagator.Extract(ctx, tracing.Metadata(msg.Metadata)))
	msg.SetContext(mctx)
	return &candidate{e: e, msg: msg, count: count, cancel: cancel}
}

// sent records c's delivery and returns it as the delivery the run loop
// watches. Only the latest delivery is watched by the loop itself (with one
// record in flight, every one is); the one watched until now, if still in a
// handler, gets a goroutine that reports on p.events.
func (p *partitionRun) sent(ctx context.Context, watched, c *candidate) *candidate {
	if watched != nil {
		p.spawn(func() { p.wait(ctx, watched) })
	}
	e := c.e
	if e.retrying {
		heap.Remove(&p.retries, e.index)
		e.retrying = false
	} else {
		heap.Remove(&p.ready, e.index)
		p.unacked++
	}
	e.state = inHandler
	e.msg = c.msg
	p.handling++
	p.reserved = false // the slot is the record's now
	p.sub.deliveries.set(p.tp, e.rec.Offset, c.count)
	return c
}

// spawn runs f, which reports once on p.events (or not at all once the run
// is over), in a goroutine of its own.
func (p *partitionRun) spawn(f func()) {
	p.reporters++
	p.waiters.Add(1)
	go func() {
		defer p.waiters.Done()
		f()
	}()
}

// report hands an outcome to the run loop, unless the run is over.
func (p *partitionRun) report(ctx context.Context, s settlement) {
	select {
	case p.events <- s:
	case <-ctx.Done():
	}
}

// hearAcksGiven settles, once ctx has ended, every record in a handler whose
// ack was given before: the run loop's select and the goroutines that watch
// the other deliveries (which stop on ctx without reporting) may have missed
// it. A handler that acked before Close or a revoke has its record committed
// by the final commit.
func (p *partitionRun) hearAcksGiven(ctx context.Context) {
	p.waiters.Wait() // every goroutine that reports has stopped: the states are final
	var heard []*entry
	for _, e := range p.window {
		if e.state != inHandler {
			continue
		}
		select {
		case <-e.msg.Acked():
			heard = append(heard, e)
		default:
		}
	}
	for _, e := range heard { // apart: settling shortens p.window
		p.settle(ctx, settlement{e: e, outcome: acked})
	}
}

// nackOf is the settlement of a nacked delivery. The metadata is read only
// after Nacked is closed, so the handler's writes to it happened before.
func nackOf(c *candidate) settlement {
	md := c.msg.Metadata
	return settlement{e: c.e, outcome: nacked, code: md.Get(metadataErrorCode), permanent: md.Get(metadataErrorPermanent) == "true"}
}

// wait reports what the handler does with a delivery the run loop no longer
// watches.
func (p *partitionRun) wait(ctx context.Context, c *candidate) {
	select {
	case <-c.msg.Acked():
		c.cancel()
		p.report(ctx, settlement{e: c.e, outcome: acked})
	case <-c.msg.Nacked():
		c.cancel()
		p.report(ctx, nackOf(c))
	case <-ctx.Done():
		c.cancel()
	}
}

func (p *partitionRun) settle(ctx context.Context, s settlement) {
	e := s.e
	switch s.outcome {
	case nacked:
		e.state = backingOff
		p.handling--
		<-p.sub.slots
		e.nacks++
		newlyHeld := s.permanent && !e.held
		e.held, e.heldCode = s.permanent, cmp.Or(s.code, "permanent")
		p.showHeld()
		pause := p.backOff(e, s.code, newlyHeld)
		p.spawn(func() {
			if sleep(ctx, pause) {
				p.report(ctx, settlement{e: e, outcome: retry})
			}
		})
	case retry:
		e.state = waiting
		e.retrying = true
		heap.Push(&p.retries, e)
	case acked:
		e.state = settled
		if e.held {
			e.held = false
			p.showHeld()
		}
		p.unacked--
		p.handling--
		<-p.sub.slots
		if e.keyed {
			q := p.byKey[e.key]
			// e is the first of its key: nothing later of the key was
			// delivered before it was acked.
			q[0] = nil
			q = q[1:]
			if len(q) == 0 {
				delete(p.byKey, e.key)
			} else {
				p.byKey[e.key] = q
				heap.Push(&p.ready, q[0])
			}
		}
		p.advance()
	}
}

// nackPause is the pause before the delivery that follows the n-th nack in
// a row of one record: base, doubled n-1 times, at most limit.
func nackPause(base, limit time.Duration, n int) time.Duration {
	d := base
	for i := 1; i < n && d < limit; i++ {
		if d > limit/2 {
			return limit
		}
		d *= 2
	}
	return min(d, limit)
}

// showHeld shows in the metrics the lowest record of the window that a
// permanent error holds, or none.
func (p *partitionRun) showHeld() {
	for _, e := range p.window {
		if e.held {
			p.held.show(true, e.rec.Offset, e.heldCode)
			return
		}
	}
	p.held.show(false, 0, "")
}

// heldHint is the first log line of a record nacked with a permanent error:
// what holds the partition, and what to configure.
const heldHint = "Record nacked with a permanent error; it holds its partition until it is acked " +
	"(nothing past it is committed, and with MaxInFlightPerPartition 1 nothing past it is delivered), " +
	"and is delivered again every retry_in, up to NackBackoffMax. Configure a PoisonQueue outside idem's middleware " +
	"(middleware.PoisonQueueWithFilter with consumer.IsPermanent), which acks it; for code empty_key " +
	"(a record without a key, such as one without the " + UUIDHeader + " header) give the consumer a key function " +
	"instead: consumer.BusinessKey, consumer.MetadataKey, or kafka.PartitionOffsetKey"

// backOff returns the pause before e's next delivery, after its latest nack,
// and logs it when it is a new step: once per record and pause, so a record
// nacked for ever logs about log2(NackBackoffMax/NackBackoff)+1 lines, the
// last at error level when the pause reaches NackBackoffMax. The nack that
// makes the record held (a permanent error) is logged at error level, with
// what to configure (heldHint).
func (p *partitionRun) backOff(e *entry, code string, newlyHeld bool) time.Duration {
	cfg := p.sub.s.cfg
	pause := nackPause(cfg.NackBackoff, cfg.NackBackoffMax, e.nacks)
	if !newlyHeld && e.nacks > 1 && pause == nackPause(cfg.NackBackoff, cfg.NackBackoffMax, e.nacks-1) {
		return pause // the same step as before: logged already
	}
	fields := watermill.LogFields{
		"partition": p.tp.partition,
		"offset":    e.rec.Offset,
		"nacks":     e.nacks,
		"retry_in":  pause,
	}
	if code != "" {
		fields["code"] = code
	}
	switch {
	case newlyHeld:
		fields["held"] = true
		p.sub.logger.Error(heldHint, nil, fields)
	case e.nacks == 1:
		p.sub.logger.Debug("Record nacked; delivering it again after a pause", fields)
	case pause < cfg.NackBackoffMax:
		p.sub.logger.Info("Record nacked again; pausing longer before delivering it again", fields)
	default:
		p.sub.logger.Error("Record nacked again and again; delivering it again every retry_in until it is acked "+
			"(a record that can never succeed needs a PoisonQueue)", nil, fields)
	}
	return pause
}

// advance drops the settled prefix of the window and reports its end.
func (p *partitionRun) advance() {
	n := 0
	for n < len(p.window) && p.window[n].state == settled {
		n++
	}
	if n == 0 {
		return
	}
	next := p.window[n-1].next
	for _, e := range p.window[:n] {
		if e.rec != nil {
			// Counted until committed: an acked record that a rebalance
			// brings back to this process before its commit counts on.
			p.sub.deliveries.forget(p.tp, e.rec.Offset)
		}
	}
	clear(p.window[:n])
	p.window = p.window[n:]
	if p.onAck != nil {
		p.onAck(p.tp.partition, next)
	}
}
