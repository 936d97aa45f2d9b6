package kafka_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/pgtest"
)

// schedule is the pause after each nack in a row of one record, until the
// cap: base, 2 base, 4 base, ..., limit.
func schedule(base, limit time.Duration) []time.Duration {
	var s []time.Duration
	for d := base; ; d *= 2 {
		if d >= limit {
			return append(s, limit)
		}
		s = append(s, d)
	}
}

// pauseAfter is the pause after the n-th nack in a row (n from 1).
func pauseAfter(steps []time.Duration, n int) time.Duration {
	return steps[min(n, len(steps))-1]
}

// mostDeliveries is the most deliveries a record nacked at once every time
// can get in window from its first, with each pause at least its step.
func mostDeliveries(steps []time.Duration, window time.Duration) int {
	n, elapsed := 1, time.Duration(0)
	for {
		elapsed += pauseAfter(steps, n)
		if elapsed > window {
			return n
		}
		n++
	}
}

// byKeyPublisher sends records keyed "p0-…" (and "poison") to partition 0 and
// every other record to partition 1.
func byKeyPublisher(t *testing.T, brokers []string) *kafka.Publisher {
	t.Helper()
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{
		WriterConfig: kafkago.WriterConfig{
			Brokers: brokers,
			Balancer: kafkago.BalancerFunc(func(m kafkago.Message, _ ...int) int {
				if k := string(m.Key); k == "poison" || strings.HasPrefix(k, "p0-") {
					return 0
				}
				return 1
			}),
			ReadTimeout:  30 * time.Second,
			WriteTimeout: 30 * time.Second,
		},
		PartitionKey: kafka.PartitionKeyFromMetadata("key"),
		Logger:       testLogger(),
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	return pub
}

func keyed(key, payload string) *message.Message {
	m := message.NewMessage(watermill.NewUUID(), []byte(payload))
	m.Metadata.Set("key", key)
	return m
}

// A record nacked again and again is delivered again after a pause that
// doubles from NackBackoff up to NackBackoffMax, per record: records of
// another partition (and, with records in flight, of other keys of the same
// partition) go on at full speed. Each new pause is logged once, with the
// code the handler side left in MetadataErrorCode.
func TestNackBackoffGrowsPerRecord(t *testing.T) {
	t.Parallel()
	const (
		base   = 20 * time.Millisecond
		limit  = 160 * time.Millisecond
		window = 2500 * time.Millisecond
	)
	steps := schedule(base, limit) // 20, 40, 80, 160 ms
	most := mostDeliveries(steps, window)
	for _, inFlight := range []int{1, 4} {
		t.Run(fmt.Sprintf("inflight=%d", inFlight), func(t *testing.T) {
			t.Parallel()
			forEachBroker(t, func(t *testing.T, brokers []string) {
				b := setup(t, brokers, 2)
				pub := byKeyPublisher(t, brokers)
				logs := newCaptureLogger()
				cfg := inFlightConfig(b.brokers, b.group, 2, inFlight)
				cfg.NackBackoff, cfg.NackBackoffMax = base, limit
				cfg.Logger = logs
				_, ch := b.subscribe(t, cfg)

				msgs := []*message.Message{keyed("poison", "never")}
				for i := range 5 {
					msgs = append(msgs, keyed("p0-"+strconv.Itoa(i), "same partition"), keyed("p1-"+strconv.Itoa(i), "other partition"))
				}
				require.NoError(t, pub.Publish(b.topic, msgs...))

				var (
					poisonAt  []time.Time
					offset    int64 = -1
					neighbour       = map[string]int{} // partition of each neighbour acked
				)
				deadline := time.After(receiveTimeout + window)
				for len(poisonAt) == 0 || time.Since(poisonAt[0]) < window {
					select {
					case msg := <-ch:
						now := time.Now()
						if msg.Metadata.Get(kafka.MetadataKey) == "poison" {
							offset = offsetOf(t, msg)
							poisonAt = append(poisonAt, now)
							msg.Metadata.Set(kafka.MetadataErrorCode, "test_code")
							msg.Nack()
							continue
						}
						neighbour[msg.Metadata.Get("key")], _ = strconv.Atoi(msg.Metadata.Get(kafka.MetadataPartition))
						msg.Ack()
					case <-time.After(10 * time.Millisecond):
					case <-deadline:
						t.Fatalf("the record to nack came %d times, within %s", len(poisonAt), receiveTimeout+window)
					}
				}
				var within int
				for _, at := range poisonAt {
					if at.Sub(poisonAt[0]) <= window {
						within++
					}
				}

				// Each pause is at least its step: doubling, then the cap.
				for i := 1; i < len(poisonAt); i++ {
					require.GreaterOrEqual(t, poisonAt[i].Sub(poisonAt[i-1]), pauseAfter(steps, i),
						"the pause after nack %d (deliveries at %v)", i, poisonAt)
				}
				// At most what the schedule allows (a fixed NackBackoff
				// would give about 100), and the pauses stop growing at the
				// cap (doubling for ever would give 7).
				require.LessOrEqual(t, within, most, "deliveries in %s", window)
				require.GreaterOrEqual(t, within, 10, "deliveries in %s: the pause must stop growing at %s", window, limit)

				// One log line per step, each with the code, the last at
				// error level.
				lines := logs.pauses(0, offset)
				require.Len(t, lines, len(steps), "%+v", lines)
				for i, l := range lines {
					require.Equal(t, steps[i], l.fields["retry_in"], "%+v", l)
					require.Equal(t, i+1, l.fields["nacks"], "%+v", l)
					require.Equal(t, "test_code", l.fields["code"], "%+v", l)
				}
				require.Equal(t, "error", lines[len(lines)-1].level)
				require.Contains(t, lines[len(lines)-1].msg, "PoisonQueue")

				// The neighbours: the other partition's records all went; with
				// records in flight, so did the other keys of the nacked
				// record's partition, and with one at a time they wait behind it.
				for i := range 5 {
					require.Equal(t, 1, neighbour["p1-"+strconv.Itoa(i)], "p1-%d", i)
					p0, delivered := neighbour["p0-"+strconv.Itoa(i)]
					if inFlight > 1 {
						require.True(t, delivered && p0 == 0, "p0-%d", i)
					} else {
						require.False(t, delivered, "p0-%d went past the nacked record of its partition", i)
					}
				}
			})
		})
	}
}

// An ack starts the count again: a record that succeeds after nacks, and the
// next record nacked on the same partition, begin at NackBackoff.
func TestNackBackoffStartsAgainAfterAck(t *testing.T) {
	t.Parallel()
	forEachBroker(t, func(t *testing.T, brokers []string) {
		b := setup(t, brokers, 1)
		sent := b.publish(t, 2)
		logs := newCaptureLogger()
		cfg := subscriberConfig(b.brokers, b.group, 1)
		cfg.NackBackoff, cfg.NackBackoffMax = 20*time.Millisecond, 80*time.Millisecond
		cfg.Logger = logs
		_, ch := b.subscribe(t, cfg)
		for _, want := range sent {
			for range 4 {
				msg := receive(t, ch)
				require.Equal(t, want.UUID, msg.UUID)
				msg.Nack()
			}
			msg := receive(t, ch)
			require.Equal(t, want.UUID, msg.UUID)
			msg.Ack()
		}
		for off := range int64(2) {
			var pauses []any
			for _, l := range logs.pauses(0, off) {
				pauses = append(pauses, l.fields["retry_in"])
			}
			require.Equal(t, []any{20 * time.Millisecond, 40 * time.Millisecond, 80 * time.Millisecond}, pauses, "offset %d", off)
		}
	})
}

// A revoke starts the count again, while the delivery count goes on: after a
// rebalance the record comes back to the same Subscribe call, and its first
// nack there pauses NackBackoff again.
func TestNackBackoffStartsAgainAfterRevoke(t *testing.T) {
	t.Parallel()
	forEachBroker(t, func(t *testing.T, brokers []string) {
		b := setup(t, brokers, 1)
		b.publish(t, 1)
		logs := newCaptureLogger()
		cfg := subscriberConfig(b.brokers, b.group, 1)
		cfg.NackBackoff, cfg.NackBackoffMax = 20*time.Millisecond, 10*time.Second
		cfg.Logger = logs
		_, ch := b.subscribe(t, cfg)
		for range 6 { // the next pause would be 640 ms
			receive(t, ch).Nack()
		}
		// A second member joins and leaves: two rebalances, each of which
		// ends this member's partition runs.
		other := newSubscriber(t, subscriberConfig(b.brokers, b.group, 1))
		_, err := other.Subscribe(context.Background(), b.topic)
		require.NoError(t, err)
		require.NoError(t, other.Close())

		msg := receive(t, ch)
		require.Equal(t, "7", msg.Metadata.Get(kafka.MetadataDeliveryCount), "the same Subscribe call counts on")
		msg.Nack()
		receive(t, ch).Ack()
		lines := logs.pauses(0, 0)
		require.Len(t, lines, 7, "%+v", lines)
		require.Equal(t, 1, lines[6].fields["nacks"])
		require.Equal(t, 20*time.Millisecond, lines[6].fields["retry_in"])
	})
}

// Behind idem's consumer middleware, without a PoisonQueue: a record without
// its business key is nacked for ever, and the Subscriber logs each new pause
// once with the code the middleware left on the message ("business_key").
// The records of the other partition are processed meanwhile.
func TestNackBackoffLogsIdemErrorCode(t *testing.T) {
	t.Parallel()
	require.Equal(t, consumer.MetadataErrorCode, kafka.MetadataErrorCode, "the middleware writes the key the adapter reads")
	forEachBroker(t, func(t *testing.T, brokers []string) {
		pool, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 4})
		b := setup(t, brokers, 2)
		pub := byKeyPublisher(t, brokers)
		idem, err := consumer.New(consumer.Config{
			Name: "payments", Pool: pool, Schema: schema,
			Key: consumer.BusinessKey(func(payload []byte) (string, error) {
				var v struct {
					ID string `json:"id"`
				}
				if err := json.Unmarshal(payload, &v); err != nil || v.ID == "" {
					return "", errors.New("the payment has no id")
				}
				return v.ID, nil
			}),
		})
		require.NoError(t, err)
		t.Cleanup(func() { _ = idem.Close() })

		logs := newCaptureLogger()
		cfg := subscriberConfig(b.brokers, b.group, 2)
		cfg.NackBackoff, cfg.NackBackoffMax = 20*time.Millisecond, 80*time.Millisecond
		cfg.Logger = logs
		sub := newSubscriber(t, cfg)
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
		require.NoError(t, err)
		var mu sync.Mutex
		var badDeliveries int
		h := router.AddConsumerHandler("payments", b.topic, sub, func(*message.Message) error { return nil })
		h.AddMiddleware(func(next message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				if msg.Metadata.Get(kafka.MetadataKey) == "poison" {
					mu.Lock()
					badDeliveries++
					mu.Unlock()
				}
				return next(msg)
			}
		}, idem.Middleware)
		ctx, cancel := context.WithCancel(context.Background())
		routed := make(chan error, 1)
		go func() { routed <- router.Run(ctx) }()
		t.Cleanup(func() {
			cancel()
			require.NoError(t, <-routed)
			require.NoError(t, sub.Close())
		})
		<-router.Running()

		msgs := []*message.Message{keyed("poison", `{"amount": 10}`)}
		for i := range 5 {
			msgs = append(msgs, keyed("p1-"+strconv.Itoa(i), fmt.Sprintf(`{"id": "pay-%d"}`, i)))
		}
		require.NoError(t, pub.Publish(b.topic, msgs...))

		// Past the cap by four deliveries: still three lines, one per step.
		pgtest.WaitFor(t, receiveTimeout, "the bad message delivered 7 times", func() bool {
			mu.Lock()
			defer mu.Unlock()
			return badDeliveries >= 3+4
		})
		pgtest.WaitFor(t, receiveTimeout, "the other partition's payments are processed", func() bool {
			var n int
			err := pool.QueryRow(context.Background(), `SELECT count(*) FROM inbox WHERE consumer = 'payments' AND state = 'completed'`).Scan(&n)
			return err == nil && n == 5
		})
		lines := logs.pauses(0, 0)
		require.Len(t, lines, 3, "%+v", lines)
		for i, l := range lines {
			require.Equal(t, "business_key", l.fields["code"], "%+v", l)
			require.Equal(t, 20*time.Millisecond<<i, l.fields["retry_in"], "%+v", l)
		}
	})
}
