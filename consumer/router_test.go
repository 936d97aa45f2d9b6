package consumer_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/pgtest"
)

// runRouter starts a router with one handler from "in" (publishing to "out"), with
// the given middlewares outermost first, and stops it when the test ends.
func runRouter(t *testing.T, pubsub *gochannel.GoChannel, h message.HandlerFunc, mws ...message.HandlerMiddleware) {
	t.Helper()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	handler := r.AddHandler("payments", "in", pubsub, "out", pubsub, h)
	handler.AddMiddleware(mws...)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = r.Run(ctx)
	}()
	<-r.Running()
	t.Cleanup(func() {
		cancel()
		<-done
	})
}

// 1,000 messages, each published three times in shuffled order, through a real
// Router: exactly 1,000 business rows and 2,000 counted duplicates.
func TestRouterEndToEndThousandTimesThree(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, mode consumer.Mode) {
		c, b := setup(t, mode, func(cfg *consumer.Config) {
			cfg.Name = "" // the Watermill handler name ("payments") is the default
			if mode != consumer.Lease {
				cfg.Batch.MaxWait = 200 * time.Microsecond
			}
		})
		pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 4096}, watermill.NopLogger{})
		defer func() { require.NoError(t, pubsub.Close()) }()
		runRouter(t, pubsub, b.bizHandler(nil), c.Middleware)

		const n = 1000
		var msgs []*message.Message
		for i := range n {
			id := consumer.NewUUID()
			for range 3 {
				msgs = append(msgs, message.NewMessage(id, fmt.Appendf(nil, `{"n":%d}`, i)))
			}
		}
		rng := rand.New(rand.NewPCG(1, 2))
		rng.Shuffle(len(msgs), func(i, j int) { msgs[i], msgs[j] = msgs[j], msgs[i] })
		require.NoError(t, pubsub.Publish("in", msgs...))

		pgtest.WaitFor(t, time.Minute, "3,000 deliveries", func() bool {
			return b.counter("idem_inbox_processed_total")+b.counter("idem_inbox_duplicates_total") >= 3*n
		})
		require.Equal(t, n, pgtest.Count(t, b.pool, `SELECT count(*) FROM biz`))
		require.Equal(t, n, pgtest.Count(t, b.pool, `SELECT count(DISTINCT key) FROM biz`))
		require.EqualValues(t, n, b.counter("idem_inbox_processed_total"))
		require.EqualValues(t, 2*n, b.counter("idem_inbox_duplicates_total"))
		require.Equal(t, n, pgtest.Count(t, b.pool, `SELECT count(*) FROM effects WHERE kind = 'email'`))
	})
}

// Messages the handler returns become publish effects with UUIDs derived from
// (consumer, key, index), stored once however often the message comes, and nothing
// goes to the router's publisher.
func TestOutputMessagesStoredOnceWithStableUUIDs(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, mode consumer.Mode) {
		c, b := setup(t, mode, func(cfg *consumer.Config) { cfg.Name = "" })
		pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, watermill.NopLogger{})
		defer func() { require.NoError(t, pubsub.Close()) }()
		published, err := pubsub.Subscribe(context.Background(), "out")
		require.NoError(t, err)

		var runs atomic.Int64
		h := func(msg *message.Message) ([]*message.Message, error) {
			n := runs.Add(1)
			out := []*message.Message{
				message.NewMessage(watermill.NewUUID(), []byte("shipped")), // a new random ID each run
				message.NewMessage(watermill.NewUUID(), []byte("invoiced")),
			}
			out[0].Metadata.Set("trace", "abc")
			if n == 1 {
				return out, fmt.Errorf("transient: broker hiccup") // rolled back; redelivered
			}
			return out, nil
		}
		runRouter(t, pubsub, h, c.Middleware)
		for range 3 {
			require.NoError(t, pubsub.Publish("in", message.NewMessage("order-7", []byte(`{}`))))
		}
		pgtest.WaitFor(t, time.Minute, "the deliveries to settle", func() bool {
			return b.counter("idem_inbox_processed_total") == 1 && b.counter("idem_inbox_duplicates_total") == 2
		})
		require.EqualValues(t, 2, runs.Load(), "the failed run and the committed one")

		rows, err := b.pool.Query(context.Background(), `SELECT kind, key, payload FROM effects ORDER BY key`)
		require.NoError(t, err)
		got := map[string][]byte{}
		for rows.Next() {
			var kind, key string
			var payload []byte
			require.NoError(t, rows.Scan(&kind, &key, &payload))
			require.Equal(t, "publish:out", kind)
			got[key] = payload
		}
		require.NoError(t, rows.Err())
		require.Len(t, got, 2)
		first, ok := got[consumer.OutputUUID("payments", "", "order-7", 0)]
		require.True(t, ok, "output 0 has the derived UUID")
		m, err := effectsdb.DecodeMessage(first)
		require.NoError(t, err)
		require.Equal(t, "shipped", string(m.Payload))
		require.Equal(t, "abc", m.Metadata.Get("trace"))
		require.Contains(t, got, consumer.OutputUUID("payments", "", "order-7", 1))

		select {
		case m := <-published:
			t.Fatalf("the router published %s directly; outputs must leave only as effects", m.UUID)
		case <-time.After(200 * time.Millisecond):
		}
	})
}

// The documented middleware order: PoisonQueue outermost, then Retry (transient
// errors only), then idem. A permanent failure is recorded once and poisoned once; a
// transient one is retried in a fresh transaction.
func TestMiddlewareOrderWithRetryAndPoisonQueue(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, mode consumer.Mode) {
		c, b := setup(t, mode, func(cfg *consumer.Config) {
			cfg.Name = ""
			cfg.PoisonOnPermanent = true
		})
		pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, watermill.NopLogger{})
		defer func() { require.NoError(t, pubsub.Close()) }()
		poisoned, err := pubsub.Subscribe(context.Background(), "poison")
		require.NoError(t, err)
		poison, err := middleware.PoisonQueueWithFilter(pubsub, "poison", consumer.IsPermanent)
		require.NoError(t, err)
		retry := middleware.Retry{MaxRetries: 3, InitialInterval: time.Millisecond, ShouldRetry: consumer.ShouldRetry}

		var flaky atomic.Int64
		h := b.bizHandler(func(msg *message.Message) error {
			switch string(msg.Payload) {
			case "bad":
				return consumer.Permanent(fmt.Errorf("amount is negative"))
			case "flaky":
				if flaky.Add(1) <= 2 {
					return fmt.Errorf("connection reset")
				}
			}
			return nil
		})
		runRouter(t, pubsub, h, poison, retry.Middleware, c.Middleware)
		require.NoError(t, pubsub.Publish("in",
			message.NewMessage("m-bad", []byte("bad")),
			message.NewMessage("m-flaky", []byte("flaky")),
			message.NewMessage("m-bad", []byte("bad"))))

		select {
		case m := <-poisoned:
			require.Equal(t, "m-bad", m.UUID)
			m.Ack()
		case <-time.After(30 * time.Second):
			t.Fatal("the permanent failure was not poisoned")
		}
		pgtest.WaitFor(t, time.Minute, "the flaky message to commit", func() bool { return b.bizRows(t, "m-flaky") == 1 })
		pgtest.WaitFor(t, time.Minute, "the replayed failure", func() bool {
			return b.counter("idem_inbox_failed_total") == 2
		})
		select {
		case m := <-poisoned:
			t.Fatalf("poisoned twice: %s", m.UUID)
		case <-time.After(200 * time.Millisecond):
		}
		require.Equal(t, 0, b.bizRows(t, "m-bad"))
		require.EqualValues(t, 3, flaky.Load(), "two transient failures retried, then success")
	})
}
