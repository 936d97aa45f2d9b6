package chaos_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/chaos"
	"github.com/idemkit/idem/internal/pgtest"
)

// prefetch is an upstream subscriber that hands out every message at once, without
// waiting for acks (as a Kafka reader with a deep fetch does), and records the
// answers each message got.
type prefetch struct {
	msgs    []*message.Message
	closing chan struct{}
	wg      sync.WaitGroup

	mu     sync.Mutex
	acks   map[string]int
	nacks  map[string]int
	closed bool
}

func newPrefetch(n int) *prefetch {
	p := &prefetch{closing: make(chan struct{}), acks: map[string]int{}, nacks: map[string]int{}}
	for i := range n {
		m := message.NewMessage(fmt.Sprintf("m-%03d", i), []byte(fmt.Sprintf(`{"n":%d}`, i)))
		m.Metadata.Set("n", fmt.Sprint(i))
		p.msgs = append(p.msgs, m)
	}
	return p
}

func (p *prefetch) Subscribe(ctx context.Context, _ string) (<-chan *message.Message, error) {
	out := make(chan *message.Message)
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		defer close(out)
		for _, m := range p.msgs {
			p.wg.Add(1)
			go p.watch(m)
			select {
			case out <- m:
			case <-p.closing:
				return
			case <-ctx.Done():
				return
			}
		}
		<-p.closing
	}()
	return out, nil
}

func (p *prefetch) watch(m *message.Message) {
	defer p.wg.Done()
	select {
	case <-m.Acked():
		p.mu.Lock()
		p.acks[m.UUID]++
		p.mu.Unlock()
	case <-m.Nacked():
		p.mu.Lock()
		p.nacks[m.UUID]++
		p.mu.Unlock()
	case <-p.closing:
	}
}

func (p *prefetch) Close() error {
	p.mu.Lock()
	if !p.closed {
		p.closed = true
		close(p.closing)
	}
	p.mu.Unlock()
	p.wg.Wait()
	return nil
}

func (p *prefetch) answers(uuid string) (acks, nacks int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.acks[uuid], p.nacks[uuid]
}

// got is one delivery as a test consumer saw it.
type got struct {
	msg  *message.Message
	kind chaos.EventKind
}

func recv(t *testing.T, ch <-chan *message.Message) got {
	t.Helper()
	select {
	case m, ok := <-ch:
		require.True(t, ok, "output channel closed")
		k, ok := chaos.KindOf(m.Context())
		require.True(t, ok, "delivery without a kind")
		return got{m, k}
	case <-time.After(30 * time.Second):
		t.Fatal("no delivery within 30 s")
	}
	return got{}
}

// drain acks everything until want deliveries arrived.
func drain(t *testing.T, ch <-chan *message.Message, want int) []got {
	t.Helper()
	var all []got
	for len(all) < want {
		g := recv(t, ch)
		g.msg.Ack()
		all = append(all, g)
	}
	return all
}

func newChaos(t *testing.T, up message.Subscriber, cfg chaos.Config) (*chaos.Subscriber, <-chan *message.Message) {
	t.Helper()
	s, err := chaos.NewSubscriber(up, cfg)
	require.NoError(t, err)
	ch, err := s.Subscribe(context.Background(), "payments")
	require.NoError(t, err)
	return s, ch
}

func newGoChannel(t *testing.T) *gochannel.GoChannel {
	t.Helper()
	return gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, watermill.NopLogger{})
}

func publish(t *testing.T, pub message.Publisher, n int) []string {
	t.Helper()
	var ids []string
	for i := range n {
		id := fmt.Sprintf("pay-%04d", i)
		m := message.NewMessage(id, []byte(fmt.Sprintf(`{"amount":%d}`, i)))
		m.Metadata.Set("trace", "t-"+id)
		require.NoError(t, pub.Publish("payments", m))
		ids = append(ids, id)
	}
	return ids
}

func TestSubscriberPassesThroughWithoutFaults(t *testing.T) {
	gc := newGoChannel(t)
	s, ch := newChaos(t, gc, chaos.Config{})
	ids := publish(t, gc, 50)
	all := drain(t, ch, 50)
	var seen []string
	for _, g := range all {
		require.Equal(t, chaos.EventOriginal, g.kind)
		require.Equal(t, "t-"+g.msg.UUID, g.msg.Metadata.Get("trace"))
		seen = append(seen, g.msg.UUID)
	}
	slices.Sort(seen)
	require.Equal(t, ids, seen)
	require.NoError(t, s.Close())
	st := s.Stats()
	require.EqualValues(t, 50, st.Received)
	require.EqualValues(t, 50, st.Delivered)
	require.EqualValues(t, 50, st.UpstreamAcked)
	require.Zero(t, st.Injected())
}

func TestSubscriberDuplicatesAreSeparateCopies(t *testing.T) {
	gc := newGoChannel(t)
	s, ch := newChaos(t, gc, chaos.Config{Seed: 1, DuplicateProbability: 1, MaxCopies: 3})
	publish(t, gc, 40)

	byID := map[string][]got{}
	deadline := time.After(30 * time.Second)
	for total := int64(0); ; {
		select {
		case m := <-ch:
			k, _ := chaos.KindOf(m.Context())
			byID[m.UUID] = append(byID[m.UUID], got{m, k})
			m.Ack()
			total++
		case <-time.After(200 * time.Millisecond):
			// Done once every message came in and every copy made of it was
			// handed on; a quiet moment alone is no proof on a loaded machine.
			if st := s.Stats(); st.Received == 40 && total == 40+st.Duplicates {
				goto done
			}
		case <-deadline:
			t.Fatalf("timeout: %+v", s.Stats())
		}
	}
done:
	require.NoError(t, s.Close())
	st := s.Stats()
	require.Len(t, byID, 40)
	var copies int64
	for id, gs := range byID {
		require.GreaterOrEqual(t, len(gs), 2, id)
		require.LessOrEqual(t, len(gs), 4, id)
		originals := 0
		for i, g := range gs {
			if g.kind == chaos.EventOriginal {
				originals++
			}
			require.Equal(t, id, g.msg.UUID)
			require.Equal(t, string(gs[0].msg.Payload), string(g.msg.Payload))
			require.Equal(t, "t-"+id, g.msg.Metadata.Get("trace"))
			for _, h := range gs[:i] {
				require.NotSame(t, h.msg, g.msg)
				// Own payload and metadata: a handler that scribbles on one copy
				// does not change the others.
				require.NotSame(t, &h.msg.Payload[0], &g.msg.Payload[0])
				g.msg.Metadata.Set("scribble", "x")
				require.Empty(t, h.msg.Metadata.Get("scribble"))
				g.msg.Metadata.Set("scribble", "")
			}
		}
		require.Equal(t, 1, originals, id)
		copies += int64(len(gs) - 1)
	}
	require.Equal(t, copies, st.Duplicates)
	require.EqualValues(t, 40, st.UpstreamAcked)
}

func TestSubscriberAckAndNackReachUpstreamOnlyFromTheOriginal(t *testing.T) {
	up := newPrefetch(1)
	s, ch := newChaos(t, up, chaos.Config{DuplicateProbability: 1, MaxCopies: 1})
	defer func() { require.NoError(t, s.Close()) }()

	a, b := recv(t, ch), recv(t, ch)
	orig, dup := a, b
	if a.kind != chaos.EventOriginal {
		orig, dup = b, a
	}
	require.Equal(t, chaos.EventOriginal, orig.kind)
	require.Equal(t, chaos.EventDuplicate, dup.kind)

	// A nacked copy is the decorator's to redeliver; upstream hears nothing.
	dup.msg.Nack()
	again := recv(t, ch)
	require.Equal(t, chaos.EventNackRedelivery, again.kind)
	require.NotSame(t, dup.msg, again.msg)
	again.msg.Ack()
	time.Sleep(20 * time.Millisecond)
	acks, nacks := up.answers("m-000")
	require.Zero(t, acks+nacks)

	// The original's ack reaches upstream, once.
	orig.msg.Ack()
	pgtest.WaitFor(t, 30*time.Second, "m-000 acked upstream", func() bool { a, _ := up.answers("m-000"); return a == 1 })
	acks, nacks = up.answers("m-000")
	require.Equal(t, [2]int{1, 0}, [2]int{acks, nacks})
	st := s.Stats()
	require.EqualValues(t, 1, st.UpstreamAcked)
	require.EqualValues(t, 1, st.NackRedeliveries)
}

func TestSubscriberNackOfTheOriginalNacksUpstream(t *testing.T) {
	up := newPrefetch(1)
	s, ch := newChaos(t, up, chaos.Config{})
	g := recv(t, ch)
	g.msg.Nack()
	pgtest.WaitFor(t, 30*time.Second, "m-000 nacked upstream", func() bool { _, n := up.answers("m-000"); return n == 1 })
	require.NoError(t, s.Close())
	acks, nacks := up.answers("m-000")
	require.Equal(t, [2]int{0, 1}, [2]int{acks, nacks})
	require.EqualValues(t, 1, s.Stats().UpstreamNacked)
}

func TestSubscriberNackOverGoChannelIsRedeliveredByIt(t *testing.T) {
	gc := newGoChannel(t)
	s, ch := newChaos(t, gc, chaos.Config{})
	publish(t, gc, 1)
	first := recv(t, ch)
	first.msg.Nack()
	second := recv(t, ch)
	require.Equal(t, first.msg.UUID, second.msg.UUID)
	require.Equal(t, chaos.EventOriginal, second.kind) // the GoChannel's own redelivery
	second.msg.Ack()
	require.NoError(t, s.Close())
	st := s.Stats()
	require.EqualValues(t, 2, st.Received)
	require.EqualValues(t, 1, st.UpstreamNacked)
	require.EqualValues(t, 1, st.UpstreamAcked)
}

func TestSubscriberRedeliversAfterAck(t *testing.T) {
	gc := newGoChannel(t)
	s, ch := newChaos(t, gc, chaos.Config{Seed: 3, RedeliverProbability: 1, RedeliverDelay: 30 * time.Millisecond})
	publish(t, gc, 20)
	ackedAt := map[string]time.Time{}
	var redelivered int
	for redelivered < 20 {
		g := recv(t, ch)
		switch g.kind {
		case chaos.EventOriginal:
			ackedAt[g.msg.UUID] = time.Now()
		case chaos.EventRedelivery:
			at, ok := ackedAt[g.msg.UUID]
			require.True(t, ok, "redelivered before the original was acked")
			require.GreaterOrEqual(t, time.Since(at), 25*time.Millisecond)
			redelivered++
		default:
			t.Fatalf("unexpected %s", g.kind)
		}
		g.msg.Ack()
	}
	require.NoError(t, s.Close())
	st := s.Stats()
	require.EqualValues(t, 20, st.Redeliveries)
	require.EqualValues(t, 20, st.UpstreamAcked, "redelivery acks never reach upstream")
}

func TestSubscriberReordersWithinTheWindow(t *testing.T) {
	up := newPrefetch(200)
	s, ch := newChaos(t, up, chaos.Config{Seed: 9, ReorderWindow: 8, ReorderIdle: time.Second})
	all := drain(t, ch, 200)
	for i := range 200 {
		pgtest.WaitFor(t, 30*time.Second, "the message acked upstream", func() bool { a, _ := up.answers(fmt.Sprintf("m-%03d", i)); return a == 1 })
	}
	require.NoError(t, s.Close())
	var order []string
	maxLag := 0
	for i, g := range all {
		order = append(order, g.msg.UUID)
		var n int
		_, _ = fmt.Sscanf(g.msg.UUID, "m-%d", &n)
		maxLag = max(maxLag, i-n, n-i)
	}
	require.False(t, slices.IsSorted(order), "nothing was reordered")
	require.Less(t, maxLag, 200, "a message was held for ever")
	sorted := slices.Clone(order)
	slices.Sort(sorted)
	require.Equal(t, slices.Compact(slices.Clone(sorted)), sorted, "each message once")
	require.Positive(t, s.Stats().Reordered)
}

func TestSubscriberDelays(t *testing.T) {
	gc := newGoChannel(t)
	s, ch := newChaos(t, gc, chaos.Config{Seed: 5, MaxDelay: 40 * time.Millisecond})
	publish(t, gc, 20)
	drain(t, ch, 20)
	require.NoError(t, s.Close())
	st := s.Stats()
	require.Positive(t, st.Delayed)
	require.LessOrEqual(t, st.Delayed, int64(20))
}

// TestSubscriberIsDeterministic: the same seed and upstream order give the same
// deliveries in the same order; another seed does not.
func TestSubscriberIsDeterministic(t *testing.T) {
	run := func(seed int64) []string {
		up := newPrefetch(150)
		var mu sync.Mutex
		var events []string
		cfg := chaos.Config{
			Seed: seed, DuplicateProbability: 0.3, MaxCopies: 2, ReorderWindow: 5, ReorderIdle: time.Second,
			RedeliverProbability: 0.2, RedeliverDelay: time.Hour, // redeliveries are decided, not reached
		}
		s, err := chaos.NewSubscriber(up, cfg)
		require.NoError(t, err)
		chaos.SetObserver(s, func(e chaos.Event) {
			mu.Lock()
			events = append(events, string(e.Kind)+":"+e.UUID)
			mu.Unlock()
		})
		ch, err := s.Subscribe(context.Background(), "payments")
		require.NoError(t, err)
		var want int
		all := []got{}
		for want = 150; len(all) < want; {
			g := recv(t, ch)
			g.msg.Ack()
			all = append(all, g)
			want = int(150 + s.Stats().Duplicates)
		}
		require.NoError(t, s.Close())
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(events)
	}
	a, b, c := run(42), run(42), run(43)
	require.Equal(t, a, b)
	require.NotEqual(t, a, c)
}

func TestSubscriberCloseWithMessagesInFlight(t *testing.T) {
	gc := newGoChannel(t)
	s, ch := newChaos(t, gc, chaos.Config{Seed: 7, DuplicateProbability: 0.5, RedeliverProbability: 0.5, MaxDelay: 5 * time.Millisecond})
	publish(t, gc, 30)
	for range 10 {
		g := recv(t, ch)
		g.msg.Ack()
	}
	recv(t, ch) // held by the handler, never answered

	done := make(chan error)
	go func() { done <- s.Close() }()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("Close hung")
	}
	// The output channel ends.
	for range ch {
	}
	require.NoError(t, s.Close(), "Close twice")
	_, err := s.Subscribe(context.Background(), "payments")
	require.Error(t, err)
}

func TestSubscriberSubscriptionEndsWithItsContext(t *testing.T) {
	gc := newGoChannel(t)
	s, err := chaos.NewSubscriber(gc, chaos.Config{DuplicateProbability: 1})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	ch, err := s.Subscribe(ctx, "payments")
	require.NoError(t, err)
	publish(t, gc, 3)
	recv(t, ch).msg.Ack()
	cancel()
	for range ch {
	}
	require.NoError(t, s.Close())
}

func TestConfigValidation(t *testing.T) {
	for _, cfg := range []chaos.Config{
		{DuplicateProbability: 1.5},
		{RedeliverProbability: -0.1},
		{MaxCopies: -1},
		{MaxDelay: -time.Second},
		{ReorderWindow: -2},
	} {
		_, err := chaos.NewSubscriber(newGoChannel(t), cfg)
		require.ErrorContains(t, err, "invalid config", "%+v", cfg)
	}
	_, err := chaos.NewSubscriber(nil, chaos.Config{})
	require.Error(t, err)
}

func TestPublisherSendsSomeMessagesTwice(t *testing.T) {
	gc := newGoChannel(t)
	defer func() { require.NoError(t, gc.Close()) }()
	in, err := gc.Subscribe(context.Background(), "payments")
	require.NoError(t, err)
	p, err := chaos.NewPublisher(gc, chaos.PublisherConfig{Seed: 11, DuplicateProbability: 0.3})
	require.NoError(t, err)

	counts := map[string]int{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	wg.Go(func() {
		for m := range in {
			mu.Lock()
			counts[m.UUID]++
			mu.Unlock()
			m.Ack()
		}
	})
	publish(t, p, 500)
	pgtest.WaitFor(t, 30*time.Second, "every message delivered", func() bool {
		mu.Lock()
		defer mu.Unlock()
		n := 0
		for _, c := range counts {
			n += c
		}
		return n == 500+int(p.Duplicates())
	})
	require.NoError(t, p.Close())
	wg.Wait()
	require.Len(t, counts, 500)
	require.EqualValues(t, 500, p.Published())
	require.InDelta(t, 150, p.Duplicates(), 45)
	for _, c := range counts {
		require.LessOrEqual(t, c, 2)
	}
}
