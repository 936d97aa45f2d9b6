package kafka_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/internal/pgtest"
)

// inFlightConfig is subscriberConfig with n records of a partition in flight.
func inFlightConfig(brokers []string, group string, partitions, n int) kafka.SubscriberConfig {
	cfg := subscriberConfig(brokers, group, partitions)
	cfg.MaxInFlightPerPartition = n
	return cfg
}

// publishKeys publishes one message per key in keys ("" publishes it without
// a key), in that order, in one call, and returns them.
func (b *testBundle) publishKeys(t *testing.T, keys []string) []*message.Message {
	t.Helper()
	msgs := make([]*message.Message, len(keys))
	for i, k := range keys {
		msgs[i] = message.NewMessage(watermill.NewUUID(), []byte(strconv.Itoa(i)))
		if k != "" {
			msgs[i].Metadata.Set("key", k)
		}
	}
	require.NoError(t, b.pub.Publish(b.topic, msgs...))
	return msgs
}

// orderKey is the unit of order with records in flight: a key of a partition.
type orderKey struct {
	partition int
	key       string
}

type partOff struct {
	partition int
	offset    int64
}

// orderChecker watches deliveries and settlements from handlers that run
// concurrently, and records every breach of the in-flight rules: two records
// of one key in flight at once, a record delivered or acked before an earlier
// record of its key was acked, a wrong delivery count. It also keeps the time
// of each ack (taken just before msg.Ack) for the commit check.
type orderChecker struct {
	unorderedWithoutKey bool

	mu          sync.Mutex
	inFlight    map[orderKey]bool
	lastAcked   map[orderKey]int64
	deliveries  map[string]int // per UUID
	current     map[int]int    // records in handlers, per partition
	maxCurrent  map[int]int
	keyless     map[int]int // keyless records in handlers, per partition
	maxKeyless  int
	ackedAt     map[partOff]time.Time
	acked       map[string]bool
	nacks       int
	violations  []string // of order
	badCounts   []string // delivery counts
	outOfOffset int      // deliveries that overtook a lower offset of their partition
	highest     map[int]int64
}

func newOrderChecker(unorderedWithoutKey bool) *orderChecker {
	return &orderChecker{
		unorderedWithoutKey: unorderedWithoutKey,
		inFlight:            map[orderKey]bool{},
		lastAcked:           map[orderKey]int64{},
		deliveries:          map[string]int{},
		current:             map[int]int{},
		maxCurrent:          map[int]int{},
		keyless:             map[int]int{},
		ackedAt:             map[partOff]time.Time{},
		acked:               map[string]bool{},
		highest:             map[int]int64{},
	}
}

func position(msg *message.Message) (int, int64) {
	p, _ := strconv.Atoi(msg.Metadata.Get(kafka.MetadataPartition))
	o, _ := strconv.ParseInt(msg.Metadata.Get(kafka.MetadataOffset), 10, 64)
	return p, o
}

func (c *orderChecker) ordered(key string) bool { return key != "" || !c.unorderedWithoutKey }

func (c *orderChecker) delivered(msg *message.Message) {
	p, off := position(msg)
	key := msg.Metadata.Get(kafka.MetadataKey)
	k := orderKey{p, key}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ordered(key) {
		if c.inFlight[k] {
			c.violations = append(c.violations, fmt.Sprintf("partition %d offset %d: key %q already has a record in flight", p, off, key))
		}
		c.inFlight[k] = true
		if last, ok := c.lastAcked[k]; ok && off <= last {
			c.violations = append(c.violations, fmt.Sprintf("partition %d offset %d of key %q delivered after offset %d was acked", p, off, key, last))
		}
	}
	if key == "" {
		c.keyless[p]++
		c.maxKeyless = max(c.maxKeyless, c.keyless[p])
	}
	c.deliveries[msg.UUID]++
	if got, want := msg.Metadata.Get(kafka.MetadataDeliveryCount), strconv.Itoa(c.deliveries[msg.UUID]); got != want {
		c.badCounts = append(c.badCounts, fmt.Sprintf("partition %d offset %d: delivery count %s, want %s", p, off, got, want))
	}
	c.current[p]++
	c.maxCurrent[p] = max(c.maxCurrent[p], c.current[p])
	if h, ok := c.highest[p]; ok && off < h {
		c.outOfOffset++
	}
	c.highest[p] = max(c.highest[p], off)
}

// settling is called just before msg.Ack or msg.Nack.
func (c *orderChecker) settling(msg *message.Message, ack bool) {
	p, off := position(msg)
	key := msg.Metadata.Get(kafka.MetadataKey)
	k := orderKey{p, key}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.current[p]--
	if key == "" {
		c.keyless[p]--
	}
	if c.ordered(key) {
		c.inFlight[k] = false
	}
	if !ack {
		c.nacks++
		return
	}
	if c.ordered(key) {
		if last, ok := c.lastAcked[k]; ok && off <= last {
			c.violations = append(c.violations, fmt.Sprintf("partition %d: offset %d of key %q acked after offset %d", p, off, key, last))
		}
		c.lastAcked[k] = off
	}
	if _, ok := c.ackedAt[partOff{p, off}]; !ok {
		c.ackedAt[partOff{p, off}] = time.Now()
	}
	c.acked[msg.UUID] = true
}

func (c *orderChecker) missing(sent []*message.Message) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, m := range sent {
		if !c.acked[m.UUID] {
			n++
		}
	}
	return n
}

// handle runs each delivery in its own goroutine, as Watermill's router
// does: a random pause of up to maxDelay, then an ack, or a nack with
// probability nackRate (never on the third delivery, so that every record
// is acked in the end).
func (c *orderChecker) handle(ch <-chan *message.Message, maxDelay time.Duration, nackRate float64) *sync.WaitGroup {
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for msg := range ch {
			c.delivered(msg)
			wg.Add(1)
			go func() {
				defer wg.Done()
				time.Sleep(rand.N(maxDelay + 1))
				nack := rand.Float64() < nackRate && msg.Metadata.Get(kafka.MetadataDeliveryCount) != "3"
				c.settling(msg, !nack)
				if nack {
					msg.Nack()
				} else {
					msg.Ack()
				}
			}()
		}
	}()
	return &wg
}

// commitSample is one reading of a partition's committed offset.
type commitSample struct {
	partition int
	committed int64
	seen      time.Time // when the reading came back: the commit is older
}

// sampleCommits reads the group's committed offsets every 5 ms until ctx
// ends, and keeps the readings that moved.
func sampleCommits(ctx context.Context, t *testing.T, b *testBundle, partitions int) func() []commitSample {
	transport := &kafkago.Transport{}
	c := &kafkago.Client{Addr: kafkago.TCP(b.brokers...), Transport: transport, Timeout: 10 * time.Second}
	ps := make([]int, partitions)
	for i := range ps {
		ps[i] = i
	}
	var mu sync.Mutex
	var samples []commitSample
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer transport.CloseIdleConnections()
		last := map[int]int64{}
		for ctx.Err() == nil {
			res, err := c.OffsetFetch(ctx, &kafkago.OffsetFetchRequest{GroupID: b.group, Topics: map[string][]int{b.topic: ps}})
			seen := time.Now()
			if err == nil {
				for _, p := range res.Topics[b.topic] {
					if p.Error == nil && p.CommittedOffset > 0 && p.CommittedOffset != last[p.Partition] {
						mu.Lock()
						samples = append(samples, commitSample{p.Partition, p.CommittedOffset, seen})
						mu.Unlock()
						last[p.Partition] = p.CommittedOffset
					}
				}
			}
			sleep(ctx, 5*time.Millisecond)
		}
	}()
	t.Cleanup(func() { <-done })
	return func() []commitSample {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(samples)
	}
}

func sleep(ctx context.Context, d time.Duration) {
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
}

// verifyCommits checks each reading: every offset below the committed one
// was acked before the reading came back. (The topics of these tests hold
// no transaction markers: every offset is a record.)
func (c *orderChecker) verifyCommits(samples []commitSample) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, s := range samples {
		for o := range s.committed {
			at, ok := c.ackedAt[partOff{s.partition, o}]
			if !ok || !at.Before(s.seen) {
				return fmt.Errorf("partition %d: offset %d was committed (read at %s) but offset %d had not been acked by then (acked later: %v)",
					s.partition, s.committed, s.seen.Format(time.RFC3339Nano), o, ok)
			}
		}
	}
	return nil
}

// randomKeys returns n keys drawn from keys distinct ones, a tenth of them
// empty (published without a key).
func randomKeys(n, keys int) []string {
	out := make([]string, n)
	for i := range out {
		if rand.IntN(10) > 0 {
			out[i] = "k" + strconv.Itoa(rand.IntN(keys))
		}
	}
	return out
}

// With several records of a partition in flight, handled concurrently with
// random delays and random nacks, records of one key are never in flight
// together and are delivered and acked in offset order; records without a
// key keep partition order among themselves (or, with UnorderedWithoutKey,
// overlap); every delivery count is right; and the group's committed offset,
// read every 5 ms while the handlers run, never passes a record that had
// not been acked by then.
func TestInFlightKeyOrderAndCommits(t *testing.T) {
	t.Parallel()
	for _, unordered := range []bool{false, true} {
		t.Run(fmt.Sprintf("UnorderedWithoutKey=%t", unordered), func(t *testing.T) {
			t.Parallel()
			forEachBroker(t, func(t *testing.T, brokers []string) {
				const partitions, n = 3, 16
				b := setup(t, brokers, partitions)
				sent := b.publishKeys(t, randomKeys(900, 40))

				c := newOrderChecker(unordered)
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				samples := sampleCommits(ctx, t, b, partitions)

				cfg := inFlightConfig(b.brokers, b.group, partitions, n)
				cfg.UnorderedWithoutKey = unordered
				sub, ch := b.subscribe(t, cfg)
				handlers := c.handle(ch, 5*time.Millisecond, 0.1)

				pgtest.WaitFor(t, time.Minute, "every message acked", func() bool {
					require.NoError(t, c.verifyCommits(samples()))
					return c.missing(sent) == 0
				})
				require.NoError(t, sub.Close())
				handlers.Wait()
				for p, end := range partitionEnds(t, b, partitions) {
					requireCommittedAt(t, b, p, end)
				}
				cancel()
				all := samples()
				require.NoError(t, c.verifyCommits(all))

				c.mu.Lock()
				defer c.mu.Unlock()
				require.Empty(t, c.violations)
				require.Empty(t, c.badCounts)
				assert.Greater(t, c.nacks, 0, "some deliveries were nacked")
				for p, m := range c.maxCurrent {
					assert.Greater(t, m, 1, "partition %d had several records in flight at once", p)
					assert.LessOrEqual(t, m, n, "partition %d had at most MaxInFlightPerPartition in flight", p)
				}
				assert.Greater(t, c.outOfOffset, 0, "records overtook earlier ones of other keys")
				if unordered {
					assert.Greater(t, c.maxKeyless, 1, "records without a key were in flight together")
				} else {
					assert.Equal(t, 1, c.maxKeyless, "records without a key were in flight one at a time")
				}
				t.Logf("%d messages, %d nacks, most in flight per partition %v, %d readings of the committed offsets checked",
					len(sent), c.nacks, c.maxCurrent, len(all))
			})
		})
	}
}

// partitionEnds returns each partition's high watermark.
func partitionEnds(t *testing.T, b *testBundle, partitions int) map[int]int64 {
	t.Helper()
	transport := &kafkago.Transport{}
	defer transport.CloseIdleConnections()
	c := &kafkago.Client{Addr: kafkago.TCP(b.brokers...), Transport: transport, Timeout: 10 * time.Second}
	var reqs []kafkago.OffsetRequest
	for p := range partitions {
		reqs = append(reqs, kafkago.LastOffsetOf(p))
	}
	res, err := c.ListOffsets(context.Background(), &kafkago.ListOffsetsRequest{Topics: map[string][]kafkago.OffsetRequest{b.topic: reqs}})
	require.NoError(t, err)
	ends := map[int]int64{}
	for _, p := range res.Topics[b.topic] {
		require.NoError(t, p.Error)
		ends[p.Partition] = p.LastOffset
	}
	require.Len(t, ends, partitions)
	return ends
}

// committedOffset is the group's committed offset of partition p, -1 if none.
func committedOffset(t *testing.T, b *testBundle, p int) int64 {
	t.Helper()
	transport := &kafkago.Transport{}
	defer transport.CloseIdleConnections()
	c := &kafkago.Client{Addr: kafkago.TCP(b.brokers...), Transport: transport, Timeout: 10 * time.Second}
	res, err := c.OffsetFetch(context.Background(), &kafkago.OffsetFetchRequest{GroupID: b.group, Topics: map[string][]int{b.topic: {p}}})
	require.NoError(t, err)
	require.Len(t, res.Topics[b.topic], 1)
	require.NoError(t, res.Topics[b.topic][0].Error)
	return res.Topics[b.topic][0].CommittedOffset
}

// requireCommittedAt waits until the group's committed offset of partition p
// is want.
func requireCommittedAt(t *testing.T, b *testBundle, p int, want int64) {
	t.Helper()
	pgtest.WaitFor(t, receiveTimeout, fmt.Sprintf("partition %d's committed offset at %d", p, want), func() bool {
		return committedOffset(t, b, p) == want
	})
}

// requireCommitStays checks, for several commit intervals, that the group's
// committed offset of partition p stays want.
func requireCommitStays(t *testing.T, b *testBundle, p int, want int64) {
	t.Helper()
	for range 10 {
		require.Equal(t, want, committedOffset(t, b, p), "partition %d", p)
		time.Sleep(kafka.DefaultCommitInterval / 2)
	}
}

func receiveN(t *testing.T, ch <-chan *message.Message, n int) map[int64]*message.Message {
	t.Helper()
	got := map[int64]*message.Message{}
	for range n {
		msg := receive(t, ch)
		_, off := position(msg)
		require.NotContains(t, got, off, "offset %d delivered twice", off)
		got[off] = msg
	}
	return got
}

// Out-of-order acks and a nack, step by step on one partition with 8 in
// flight: the committed offset stays at the first unacked record while later
// ones are acked, a nack redelivers only that record (delivery count 2) and
// holds the commit back, not the delivery of later records, and the ack of
// the nacked record commits everything acked after it.
func TestInFlightCommitsOnlyTheAckedPrefix(t *testing.T) {
	t.Parallel()
	forEachBroker(t, func(t *testing.T, brokers []string) {
		b := setup(t, brokers, 1)
		keys := make([]string, 12)
		for i := range keys {
			keys[i] = "k" + strconv.Itoa(i)
		}
		sent := b.publishKeys(t, keys)
		_, ch := b.subscribe(t, inFlightConfig(b.brokers, b.group, 1, 8))

		first := receiveN(t, ch, 8)
		for off := range int64(8) {
			require.Contains(t, first, off)
			assert.Equal(t, sent[off].UUID, first[off].UUID)
			assert.Equal(t, "1", first[off].Metadata.Get(kafka.MetadataDeliveryCount))
		}
		requireNothing(t, ch, 300*time.Millisecond) // 8 in flight: no ninth

		for _, off := range []int64{7, 5, 3, 1, 2, 4, 6} {
			first[off].Ack()
		}
		// Seven slots freed: the other four come, while 0 is still unacked.
		rest := receiveN(t, ch, 4)
		for off := int64(8); off < 12; off++ {
			require.Contains(t, rest, off)
		}
		requireCommitStays(t, b, 0, -1)

		first[0].Nack()
		again := receive(t, ch)
		_, off := position(again)
		require.Equal(t, int64(0), off, "only the nacked record comes again")
		assert.Equal(t, "2", again.Metadata.Get(kafka.MetadataDeliveryCount))
		for _, m := range rest {
			m.Ack()
		}
		requireCommitStays(t, b, 0, -1)

		again.Ack()
		requireCommittedAt(t, b, 0, 12)
		requireNothing(t, ch, 300*time.Millisecond)
	})
}

// Closing a subscriber with records in flight commits the acked prefix and
// nothing past it; acks that come after the close change nothing; the next
// member starts at the first unacked record.
func TestInFlightCloseCommitsOnlyTheAckedPrefix(t *testing.T) {
	t.Parallel()
	forEachBroker(t, func(t *testing.T, brokers []string) {
		b := setup(t, brokers, 1)
		keys := make([]string, 8)
		for i := range keys {
			keys[i] = "k" + strconv.Itoa(i)
		}
		sent := b.publishKeys(t, keys)
		sub1, ch1 := b.subscribe(t, inFlightConfig(b.brokers, b.group, 1, 8))
		got := receiveN(t, ch1, 8)
		for _, off := range []int64{6, 0, 2, 5, 1} {
			got[off].Ack()
		}
		requireCommittedAt(t, b, 0, 3)
		require.NoError(t, sub1.Close())
		for _, off := range []int64{3, 4, 7} {
			got[off].Ack() // too late: the partition is released
		}
		requireCommitStays(t, b, 0, 3)

		_, ch2 := b.subscribe(t, inFlightConfig(b.brokers, b.group, 1, 8))
		again := receiveN(t, ch2, 5)
		for off := int64(3); off < 8; off++ {
			require.Contains(t, again, off)
			assert.Equal(t, sent[off].UUID, again[off].UUID)
			again[off].Ack()
		}
		requireCommittedAt(t, b, 0, 8)
	})
}

// Two members share a topic while each holds many records in flight with
// slow handlers; a member joins and one leaves mid-flight. No message is
// lost (duplicates are fine), the committed offsets never pass an unacked
// record, and delivery counts stay right: a record acked but not committed
// when its partition moved within a process counts on. (Key order is not
// checked here: a revoked member's handlers still run while the partition's
// next generation delivers the same records again.)
func TestInFlightRebalanceLosesNothing(t *testing.T) {
	t.Parallel()
	forEachBroker(t, func(t *testing.T, brokers []string) {
		const partitions, n = 4, 32
		b := setup(t, brokers, partitions)
		sent := b.publishKeys(t, randomKeys(400, 50))

		// One checker per member: order holds within a member's run.
		// Acks go to a shared log for the commit check.
		c1, c2 := newOrderChecker(false), newOrderChecker(false)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		samples := sampleCommits(ctx, t, b, partitions)

		sub1, ch1 := b.subscribe(t, inFlightConfig(b.brokers, b.group, partitions, n))
		h1 := c1.handle(ch1, 20*time.Millisecond, 0.05)
		pgtest.WaitFor(t, receiveTimeout, "50 messages acked by the first member", func() bool {
			c1.mu.Lock()
			defer c1.mu.Unlock()
			return len(c1.acked) >= 50
		})

		sub2, ch2 := b.subscribe(t, inFlightConfig(b.brokers, b.group, partitions, n))
		h2 := c2.handle(ch2, 20*time.Millisecond, 0.05)
		sent = append(sent, b.publishKeys(t, randomKeys(400, 50))...)
		pgtest.WaitFor(t, receiveTimeout, "50 messages acked by the second member", func() bool {
			c2.mu.Lock()
			defer c2.mu.Unlock()
			return len(c2.acked) >= 50
		})

		c1.mu.Lock()
		inFlight := 0
		for _, k := range c1.current {
			inFlight += k
		}
		c1.mu.Unlock()
		require.NoError(t, sub1.Close())
		h1.Wait()
		sent = append(sent, b.publishKeys(t, randomKeys(200, 50))...)

		acked := func() map[string]bool {
			all := map[string]bool{}
			for _, c := range []*orderChecker{c1, c2} {
				c.mu.Lock()
				for id := range c.acked {
					all[id] = true
				}
				c.mu.Unlock()
			}
			return all
		}
		pgtest.WaitFor(t, time.Minute, "every message acked by one member or the other", func() bool {
			a := acked()
			for _, m := range sent {
				if !a[m.UUID] {
					return false
				}
			}
			return true
		})
		for p, end := range partitionEnds(t, b, partitions) {
			requireCommittedAt(t, b, p, end)
		}
		cancel()
		require.NoError(t, sub2.Close())
		h2.Wait()

		// The commit check against both members' acks.
		merged := newOrderChecker(false)
		dups := 0
		for _, c := range []*orderChecker{c1, c2} {
			c.mu.Lock()
			require.Empty(t, c.badCounts)
			for k, at := range c.ackedAt {
				if prev, ok := merged.ackedAt[k]; ok {
					dups++
					if prev.Before(at) {
						continue
					}
				}
				merged.ackedAt[k] = at
			}
			c.mu.Unlock()
		}
		all := samples()
		require.NoError(t, merged.verifyCommits(all))
		t.Logf("%d messages; member 1 had %d in flight when it left; %d acked by both; %d readings of the committed offsets checked",
			len(sent), inFlight, dups, len(all))
	})
}

// With fewer slots than partitions want, partitions take turns: one
// Subscribe call has at most MaxConcurrentPartitions ×
// MaxInFlightPerPartition records in handlers, and a partition whose
// handlers are never all idle does not keep the others out.
func TestInFlightPartitionsTakeTurns(t *testing.T) {
	t.Parallel()
	forEachBroker(t, func(t *testing.T, brokers []string) {
		const partitions, n = 2, 4
		b := setup(t, brokers, partitions)
		sent := b.publishKeys(t, randomKeys(400, 100))

		cfg := inFlightConfig(b.brokers, b.group, partitions, n)
		cfg.MaxConcurrentPartitions = 1
		_, ch := b.subscribe(t, cfg)
		var mu sync.Mutex
		current, most := 0, 0
		var order []int // partitions in ack order
		done := make(chan struct{})
		go func() {
			defer close(done)
			var wg sync.WaitGroup
			defer wg.Wait()
			for range sent {
				var msg *message.Message
				select {
				case msg = <-ch:
				case <-time.After(time.Minute):
					return // the test fails below
				}
				mu.Lock()
				current++
				most = max(most, current)
				mu.Unlock()
				wg.Add(1)
				go func() {
					defer wg.Done()
					time.Sleep(rand.N(2 * time.Millisecond))
					p, _ := position(msg)
					mu.Lock()
					current--
					order = append(order, p)
					mu.Unlock()
					msg.Ack()
				}()
			}
		}()
		<-done
		mu.Lock()
		defer mu.Unlock()
		require.Len(t, order, len(sent), "every message came within a minute")
		assert.LessOrEqual(t, most, n, "at most MaxConcurrentPartitions × MaxInFlightPerPartition in handlers")
		// Both partitions are served within the first quarter of the acks.
		first := map[int]int{}
		for _, p := range order[:len(order)/4] {
			first[p]++
		}
		assert.Len(t, first, partitions, "both partitions had turns early on: %v", first)
		t.Logf("most in handlers %d; acks per partition in the first quarter %v", most, first)
	})
}

// Records acked just before Close are committed by Close: with 64 records of
// distinct keys in handlers at once, the test acks them all and closes the
// subscriber at once; when Close returns, the group's committed offset is past
// every one of them. (A run loop that stopped on Close without hearing the acks
// already given left some of them uncommitted, to be delivered again.)
func TestAcksBeforeCloseAreCommitted(t *testing.T) {
	t.Parallel()
	forEachBroker(t, func(t *testing.T, brokers []string) {
		const n = 64
		for round := range 5 {
			b := setup(t, brokers, 1)
			keys := make([]string, n)
			for i := range keys {
				keys[i] = "k" + strconv.Itoa(i)
			}
			b.publishKeys(t, keys)
			sub, ch := b.subscribe(t, inFlightConfig(b.brokers, b.group, 1, n))
			got := receiveN(t, ch, n)
			for _, msg := range got {
				msg.Ack()
			}
			require.NoError(t, sub.Close())
			require.Equal(t, int64(n), committedOffset(t, b, 0), "round %d: the committed offset after Close", round)
		}
	})
}
