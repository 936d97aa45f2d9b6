package nats_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	idemnats "github.com/idemkit/idem/adapters/nats"
)

// holder is a batching handler downstream: it takes messages off a channel
// and holds them, unacked, until it has a full batch, then acks them all.
type holder struct {
	mu      sync.Mutex
	held    []*message.Message
	most    int            // the most held at once
	seen    map[string]int // deliveries per UUID
	redeliv int            // deliveries with nats_num_delivered above 1
}

func newHolder() *holder { return &holder{seen: map[string]int{}} }

func (h *holder) take(m *message.Message) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.held = append(h.held, m)
	h.most = max(h.most, len(h.held))
	h.seen[m.UUID]++
	if m.Metadata.Get(idemnats.MetadataNumDelivered) != "1" {
		h.redeliv++
	}
}

func (h *holder) count() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.held)
}

func (h *holder) ackAll() {
	h.mu.Lock()
	held := h.held
	h.held = nil
	h.mu.Unlock()
	for _, m := range held {
		m.Ack()
	}
}

// A batching handler downstream sees a full Concurrency of messages at once,
// and messages that wait (first in the subscriber, for a handler that reads
// them slowly, then in the handler's batch) longer than the consumer's
// AckWait are not redelivered: the subscriber keeps each one in progress
// from the moment it arrives. AckWait 1 s here; each message waits 1.5 s to
// 3 s before its ack.
func TestBatchOutlastsAckWait(t *testing.T) {
	t.Parallel()
	forEachServer(t, func(t *testing.T, url string) {
		const conc, batches = 32, 3
		b := setup(t, url)
		sub := b.subscriber(t, idemnats.SubscriberConfig{
			Concurrency: conc,
			Consumer:    jetstream.ConsumerConfig{AckWait: time.Second},
		})
		require.NoError(t, sub.SubscribeInitialize(b.topic))
		sent := b.publish(t, conc*batches)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		msgs, err := sub.Subscribe(ctx, b.topic)
		require.NoError(t, err)

		h := newHolder()
		for range batches {
			start := time.Now()
			for h.count() < conc {
				m := receive(t, msgs, 30*time.Second)
				h.take(m)
				time.Sleep(50 * time.Millisecond) // a slow reader: the last waits 1.5 s
			}
			time.Sleep(1500 * time.Millisecond) // the batch is held past AckWait
			t.Logf("batch of %d held %s", conc, time.Since(start).Round(time.Millisecond))
			h.ackAll()
		}
		nothing(t, msgs, 2*time.Second) // two AckWaits: nothing comes back

		h.mu.Lock()
		defer h.mu.Unlock()
		assert.Equal(t, conc, h.most, "the handler held a full Concurrency at once")
		assert.Len(t, h.seen, len(sent))
		assert.Zero(t, h.redeliv, "no delivery was a redelivery")
		for id, n := range h.seen {
			assert.Equal(t, 1, n, "message %s delivered once", id)
		}
		c, err := b.js.Consumer(context.Background(), b.topo.StreamName(b.topic), "test")
		require.NoError(t, err)
		info, err := c.Info(context.Background())
		require.NoError(t, err)
		assert.Zero(t, info.NumRedelivered, "the server redelivered nothing")
		assert.Zero(t, info.NumAckPending)
		st := sub.Stats()
		t.Logf("%d messages in %d pulls; server: %d redelivered", st.Pulled, st.Pulls, info.NumRedelivered)
	})
}

// Several subscribers of one durable each hold a full Concurrency of
// messages at once, with the default MaxAckPending: it bounds the durable as
// a whole, so it must be well above Concurrency times the subscribers (equal to
// Concurrency, it would make the server give the subscribers one Concurrency
// between them all).
func TestSubscribersOfADurableEachGetFullBatches(t *testing.T) {
	t.Parallel()
	forEachServer(t, func(t *testing.T, url string) {
		const conc, subs = 32, 3
		b := setup(t, url)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		holders := make([]*holder, subs)
		chans := make([]<-chan *message.Message, subs)
		for i := range subs {
			s := b.subscriber(t, idemnats.SubscriberConfig{Concurrency: conc})
			var err error
			chans[i], err = s.Subscribe(ctx, b.topic)
			require.NoError(t, err)
			holders[i] = newHolder()
		}
		b.publish(t, conc*subs*2)

		// Every subscriber fills its batch while the others hold theirs.
		var wg sync.WaitGroup
		for i := range subs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				deadline := time.After(15 * time.Second)
				for holders[i].count() < conc {
					select {
					case m := <-chans[i]:
						holders[i].take(m)
					case <-deadline:
						return
					}
				}
			}()
		}
		wg.Wait()
		for i, h := range holders {
			assert.Equal(t, conc, h.count(), "subscriber %d holds a full batch while the others hold theirs", i)
		}
		for _, h := range holders {
			h.ackAll()
		}
	})
}

// FetchBatch makes the subscriber wait for that many free slots before it
// pulls: every pull but the first and the last brings at least FetchBatch
// messages, even when handlers ack one by one.
func TestFetchBatchWaitsForFreeSlots(t *testing.T) {
	t.Parallel()
	forEachServer(t, func(t *testing.T, url string) {
		const n = 400
		for _, fetch := range []int{1, 16} {
			b := setup(t, url)
			sub := b.subscriber(t, idemnats.SubscriberConfig{Concurrency: 32, FetchBatch: fetch})
			require.NoError(t, sub.SubscribeInitialize(b.topic))
			b.publish(t, n)
			ctx, cancel := context.WithCancel(context.Background())
			msgs, err := sub.Subscribe(ctx, b.topic)
			require.NoError(t, err)
			var wg sync.WaitGroup
			for range n {
				m := receive(t, msgs, 30*time.Second)
				wg.Add(1)
				go func() { // acks one by one, as per-message handlers do
					defer wg.Done()
					time.Sleep(time.Millisecond)
					m.Ack()
				}()
			}
			wg.Wait()
			cancel()
			st := sub.Stats()
			t.Logf("FetchBatch %d: %d messages in %d pulls (%.1f a pull)", fetch, st.Pulled, st.Pulls,
				float64(st.Pulled)/float64(st.Pulls))
			// The first pull asks for all 32; each later one for at least 16.
			if fetch > 1 {
				assert.LessOrEqual(t, st.Pulls, uint64(1+(n-32)/fetch+2), "pulls of at least %d", fetch)
			}
		}
	})
}
