package nats_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	idemnats "github.com/idemkit/idem/adapters/nats"
)

// BenchmarkSubscribeAck measures subscribe-with-ack throughput: b.N messages
// of 64 bytes are stored first (pipelined publish), then one Subscriber drains
// them with the given Concurrency, acking each (a plain ack, the default).
// Only the draining is timed. Run it with a fixed count, for example
// go test -run '^$' -bench SubscribeAck -benchtime 20000x ./adapters/nats/
// (add NATS_URL to measure an external server).
func BenchmarkSubscribeAck(b *testing.B) {
	for _, conc := range []int{1, 16, 64} {
		b.Run(fmt.Sprintf("concurrency=%d", conc), func(b *testing.B) {
			url := serverURL(b)
			topo := topology(namespace(b, url))
			topic := newTopic()
			nc := connect(b, url)

			pub, err := idemnats.NewPublisher(nc, idemnats.PublisherConfig{Topology: topo, MaxInFlight: 1024})
			require.NoError(b, err)
			defer pub.Close()
			sub, err := idemnats.NewSubscriber(nc, idemnats.SubscriberConfig{Topology: topo, Durable: "bench", Concurrency: conc})
			require.NoError(b, err)
			defer sub.Close()
			require.NoError(b, sub.SubscribeInitialize(topic))

			payload := make([]byte, 64)
			const chunk = 1000
			for i := 0; i < b.N; i += chunk {
				batch := make([]*message.Message, 0, chunk)
				for j := i; j < min(i+chunk, b.N); j++ {
					batch = append(batch, message.NewMessage(fmt.Sprintf("m-%d", j), payload))
				}
				require.NoError(b, pub.Publish(topic, batch...))
			}

			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			b.ResetTimer()
			msgs, err := sub.Subscribe(ctx, topic)
			require.NoError(b, err)
			timeout := time.After(5 * time.Minute)
			for range b.N {
				select {
				case m := <-msgs:
					m.Ack()
				case <-timeout:
					b.Fatal("timed out")
				}
			}
			b.StopTimer()
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "msg/s")
		})
	}
}
