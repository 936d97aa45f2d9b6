package kafka_test

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/adapters/kafka"
)

// payload16 matches the smallest message size of Watermill's benchmark.
var payload16 = []byte("0123456789abcdef")

// BenchmarkSubscribeAck measures how fast one Subscriber (one group member)
// delivers and acks messages that are already in the topic: the number the
// README compares with Watermill's "Subscribe (messages / s)".
func BenchmarkSubscribeAck(b *testing.B) {
	brokers := externalBrokers()
	if brokers == nil {
		brokers = startCluster(b)
	}
	for _, partitions := range []int{1, 4, 16} {
		b.Run(fmt.Sprintf("partitions=%d", partitions), func(b *testing.B) {
			topic, group := "bench-"+uuid.NewString(), "bench-"+uuid.NewString()
			cfg := subscriberConfig(brokers, group, partitions)
			init := newSubscriber(b, cfg)
			require.NoError(b, init.SubscribeInitialize(topic))
			require.NoError(b, init.Close())

			pub := newPublisher(b, brokers, nil)
			batch := make([]*message.Message, 0, 1000)
			for i := 0; i < b.N; i++ {
				batch = append(batch, message.NewMessage(watermill.NewUUID(), payload16))
				if len(batch) == cap(batch) || i == b.N-1 {
					require.NoError(b, pub.Publish(topic, batch...))
					batch = batch[:0]
				}
			}
			require.NoError(b, pub.Close())

			sub := newSubscriber(b, cfg)
			defer sub.Close()
			b.ResetTimer()
			start := time.Now()
			ch, err := sub.Subscribe(context.Background(), topic)
			require.NoError(b, err)
			seen := make(map[string]struct{}, b.N)
			for len(seen) < b.N {
				msg := <-ch
				seen[msg.UUID] = struct{}{}
				msg.Ack()
			}
			b.StopTimer()
			b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "msgs/s")
		})
	}
}

// BenchmarkPublish measures synchronous single-message Publish calls from
// 16 goroutines, each returning after acks=all.
func BenchmarkPublish(b *testing.B) {
	brokers := externalBrokers()
	if brokers == nil {
		brokers = startCluster(b)
	}
	topic := "bench-" + uuid.NewString()
	init := newSubscriber(b, subscriberConfig(brokers, "", 4))
	require.NoError(b, init.SubscribeInitialize(topic))
	require.NoError(b, init.Close())
	pub := newPublisher(b, brokers, nil)
	defer pub.Close()

	b.SetParallelism(8) // GOMAXPROCS=2 here: 16 publishers
	b.ResetTimer()
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		i := 0
		for pb.Next() {
			i++
			msg := message.NewMessage(watermill.NewUUID(), payload16)
			msg.Metadata.Set("n", strconv.Itoa(i))
			if err := pub.Publish(topic, msg); err != nil {
				b.Error(err)
				return
			}
		}
	})
	b.StopTimer()
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "msgs/s")
}

var _ = kafka.DefaultMaxWait
