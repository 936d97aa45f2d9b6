package kafka_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/pgtest"
)

// syncBuffer is a bytes.Buffer that a logger and the test share.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// lines decodes the JSON lines written so far.
func (b *syncBuffer) lines(t *testing.T) []map[string]any {
	t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []map[string]any
	dec := json.NewDecoder(bytes.NewReader(b.buf.Bytes()))
	for dec.More() {
		var m map[string]any
		require.NoError(t, dec.Decode(&m))
		out = append(out, m)
	}
	return out
}

// heldSeries returns the Subscriber's held gauge for the partition and the
// held-offset series of it, each series' labels with its value.
func heldSeries(t *testing.T, reg *prometheus.Registry, group, topic string, partition int) (held float64, offsets map[string]float64) {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	held = -1
	offsets = map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			l := labelMap(m)
			if l["group"] != group || l["topic"] != topic || l["partition"] != strconv.Itoa(partition) {
				continue
			}
			switch mf.GetName() {
			case kafka.MetricPartitionHeld:
				held = m.GetGauge().GetValue()
			case kafka.MetricPartitionHeldOffset:
				offsets[l["code"]] = m.GetGauge().GetValue()
			}
		}
	}
	return held, offsets
}

func labelMap(m *dto.Metric) map[string]string {
	out := map[string]string{}
	for _, l := range m.GetLabel() {
		out[l.GetName()] = l.GetValue()
	}
	return out
}

// A record written by kafka-go's own Writer (no UUID header, so no idem key),
// then 20 payments with their UUIDs, behind idem's middleware with the default
// key and no PoisonQueue: the record holds its partition, and every place the
// operator looks says so and what to configure. The middleware's error (code
// empty_key) and the consumer's first log line name the key functions and the
// PoisonQueue; the Subscriber's first log line for the record is at error
// level and says the same; its metrics show the partition held at the record's
// offset with the code. Once a PoisonQueue takes the record (it is acked), the
// held series go, and the 20 payments are committed, each once, with their
// bytes.
func TestRecordWithoutKeyHoldsItsPartitionVisibly(t *testing.T) {
	t.Parallel()
	require.Equal(t, consumer.MetadataErrorPermanent, kafka.MetadataErrorPermanent, "the middleware writes the key the adapter reads")
	forEachBroker(t, func(t *testing.T, brokers []string) {
		pool, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 4})
		_, err := pool.Exec(context.Background(), `CREATE TABLE payments (id text PRIMARY KEY, body bytea NOT NULL)`)
		require.NoError(t, err)
		b := setup(t, brokers, 1)

		var consumerLog syncBuffer
		idem, err := consumer.New(consumer.Config{
			Name: "payments", Pool: pool, Schema: schema,
			Logger: slog.New(slog.NewJSONHandler(&consumerLog, &slog.HandlerOptions{Level: slog.LevelDebug})),
		})
		require.NoError(t, err)
		t.Cleanup(func() { _ = idem.Close() })

		reg := prometheus.NewRegistry()
		logs := newCaptureLogger()
		cfg := subscriberConfig(b.brokers, b.group, 1)
		cfg.NackBackoff, cfg.NackBackoffMax = 20*time.Millisecond, 80*time.Millisecond
		cfg.Logger = logs
		cfg.Registerer = reg
		sub := newSubscriber(t, cfg)

		// The poison topic: an in-memory one, read back at the end.
		poisonPubSub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
		t.Cleanup(func() { _ = poisonPubSub.Close() })
		poisoned, err := poisonPubSub.Subscribe(context.Background(), "payments.poison")
		require.NoError(t, err)
		poisonQueue, err := middleware.PoisonQueueWithFilter(poisonPubSub, "payments.poison", consumer.IsPermanent)
		require.NoError(t, err)

		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
		require.NoError(t, err)
		var (
			mu       sync.Mutex
			firstErr error // the middleware's error for the record without a key
			poisonOn bool  // the operator has configured the PoisonQueue
		)
		h := router.AddConsumerHandler("payments", b.topic, sub, func(msg *message.Message) error {
			_, err := consumer.Tx(msg.Context()).Exec(msg.Context(),
				`INSERT INTO payments (id, body) VALUES ($1, $2)`, msg.UUID, msg.Payload)
			return err
		})
		h.AddMiddleware(func(next message.HandlerFunc) message.HandlerFunc {
			withPoison := poisonQueue(next)
			return func(msg *message.Message) ([]*message.Message, error) {
				mu.Lock()
				on := poisonOn
				mu.Unlock()
				if on {
					return withPoison(msg)
				}
				out, err := next(msg)
				if err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = err
					}
					mu.Unlock()
				}
				return out, err
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

		// The raw record, as another producer writes it: no headers.
		transport := &kafkago.Transport{}
		w := &kafkago.Writer{Addr: kafkago.TCP(brokers...), Topic: b.topic, RequiredAcks: kafkago.RequireAll, Transport: transport,
			BatchTimeout: time.Millisecond, WriteTimeout: 30 * time.Second, ReadTimeout: 30 * time.Second}
		raw := []byte(`{"amount": 10}`)
		require.NoError(t, w.WriteMessages(context.Background(), kafkago.Message{Value: raw}))
		require.NoError(t, w.Close())
		transport.CloseIdleConnections()
		payments := make([]*message.Message, 20)
		for i := range payments {
			payments[i] = message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, `{"id": "pay-%d"}`, i))
		}
		require.NoError(t, b.pub.Publish(b.topic, payments...))

		// Held: the gauge is 1, the offset series names the record and the code.
		pgtest.WaitFor(t, receiveTimeout, "the partition shown held", func() bool {
			held, offsets := heldSeries(t, reg, b.group, b.topic, 0)
			return held == 1 && len(offsets) == 1
		})
		pgtest.WaitFor(t, receiveTimeout, "the record nacked 4 times (past the pause cap)", func() bool {
			return len(logs.pauses(0, 0)) >= 3
		})
		held, offsets := heldSeries(t, reg, b.group, b.topic, 0)
		require.Equal(t, 1.0, held)
		require.Equal(t, map[string]float64{"empty_key": 0}, offsets, "the record's offset, with its code")
		require.Equal(t, 0, pgtest.Count(t, pool, `SELECT count(*) FROM payments`), "nothing passes the held record")

		// The middleware's error: the empty key, and what to configure.
		mu.Lock()
		err = firstErr
		mu.Unlock()
		require.ErrorIs(t, err, consumer.ErrEmptyKey)
		require.Equal(t, "empty_key", inbox.Code(err))
		require.True(t, consumer.IsPermanent(err))
		for _, want := range []string{"idem: empty idempotency key", "_watermill_message_uuid", "Config.Key",
			"consumer.BusinessKey", "consumer.MetadataKey", "kafka.PartitionOffsetKey", "middleware.PoisonQueue", "holds its partition"} {
			require.Contains(t, err.Error(), want)
		}

		// The consumer's first log line: an error, with that error.
		lines := consumerLog.lines(t)
		require.NotEmpty(t, lines)
		first := lines[0]
		require.Equal(t, "ERROR", first["level"], "%v", first)
		require.Equal(t, "empty_key", first["code"], "%v", first)
		require.Equal(t, err.Error(), first["err"], "%v", first)
		require.Contains(t, first["msg"], "PoisonQueue")

		// The Subscriber's first line about the record: an error that says
		// what holds the partition and what to configure.
		pauses := logs.pauses(0, 0)
		line := pauses[0]
		require.Equal(t, "error", line.level, "%+v", line)
		require.Equal(t, 1, line.fields["nacks"])
		require.Equal(t, "empty_key", line.fields["code"])
		require.Equal(t, true, line.fields["held"])
		for _, want := range []string{"holds its partition", "PoisonQueue", "consumer.IsPermanent", "empty_key",
			"consumer.BusinessKey", "consumer.MetadataKey", "kafka.PartitionOffsetKey"} {
			require.Contains(t, line.msg, want)
		}

		// The operator configures the PoisonQueue: the record is poisoned
		// (acked), the partition is no longer held, and the payments go.
		mu.Lock()
		poisonOn = true
		mu.Unlock()
		select {
		case msg := <-poisoned:
			require.Equal(t, raw, []byte(msg.Payload), "the raw record's bytes are poisoned")
			require.Equal(t, "0", msg.Metadata.Get(kafka.MetadataOffset))
			msg.Ack()
		case <-time.After(receiveTimeout):
			t.Fatal("the record was not poisoned")
		}
		pgtest.WaitFor(t, receiveTimeout, "the 20 payments committed", func() bool {
			return pgtest.Count(t, pool, `SELECT count(*) FROM payments`) == 20
		})
		for _, p := range payments {
			var body []byte
			require.NoError(t, pool.QueryRow(context.Background(), `SELECT body FROM payments WHERE id = $1`, p.UUID).Scan(&body))
			require.Equal(t, []byte(p.Payload), body)
		}
		held, offsets = heldSeries(t, reg, b.group, b.topic, 0)
		require.Equal(t, 0.0, held, "no longer held")
		require.Empty(t, offsets, "the held offset's series is gone")
	})
}
