package nats_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
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
			defer func() { require.NoError(b, pub.Close()) }()
			sub, err := idemnats.NewSubscriber(nc, idemnats.SubscriberConfig{Topology: topo, Durable: "bench", Concurrency: conc})
			require.NoError(b, err)
			defer func() { require.NoError(b, sub.Close()) }()
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

// What BenchmarkInFlight's handlers do: a pause before the ack of about a
// group commit's round trip to Postgres, and for the batching handler idem's
// group-commit defaults (consumer.DefaultMaxBatch, DefaultMaxWait,
// DefaultWorkers).
const (
	benchHandlerDelay = 2 * time.Millisecond
	benchMaxBatch     = 32
	benchMaxWait      = 2 * time.Millisecond
	benchWorkers      = 2
)

// benchHandler consumes a subscription's messages the way a Watermill router
// in front of idem does, and counts them down on done.
type benchHandler interface {
	run(msgs <-chan *message.Message, done *sync.WaitGroup)
	// meanBatch is the mean number of messages acked together.
	meanBatch() float64
}

// delayHandler handles each message in its own goroutine: a fixed pause,
// then the ack.
type delayHandler struct{}

func (delayHandler) run(msgs <-chan *message.Message, done *sync.WaitGroup) {
	for m := range msgs {
		go func() {
			time.Sleep(benchHandlerDelay)
			m.Ack()
			done.Done()
		}()
	}
}

func (delayHandler) meanBatch() float64 { return 1 }

// batchHandler is idem's group commit in miniature: each message is handed
// to one of benchWorkers workers, which takes the first waiting message,
// collects more for up to benchMaxWait or benchMaxBatch messages, then
// "commits" (a benchHandlerDelay pause) and acks them all.
type batchHandler struct {
	batches, msgs atomic.Int64
}

func (h *batchHandler) run(msgs <-chan *message.Message, done *sync.WaitGroup) {
	reqs := make(chan *message.Message)
	stop := make(chan struct{})
	var workers sync.WaitGroup
	for range benchWorkers {
		workers.Add(1)
		go func() {
			defer workers.Done()
			for {
				var batch []*message.Message
				select {
				case m := <-reqs:
					batch = append(batch, m)
				case <-stop:
					return
				}
				wait := time.NewTimer(benchMaxWait)
			collect:
				for len(batch) < benchMaxBatch {
					select {
					case m := <-reqs:
						batch = append(batch, m)
					case <-wait.C:
						break collect
					}
				}
				wait.Stop()
				time.Sleep(benchHandlerDelay)
				for _, m := range batch {
					m.Ack()
					done.Done()
				}
				h.batches.Add(1)
				h.msgs.Add(int64(len(batch)))
			}
		}()
	}
	var handing sync.WaitGroup
	for m := range msgs {
		handing.Add(1)
		go func() { // a router's handler goroutine, blocked until a worker takes it
			defer handing.Done()
			reqs <- m
		}()
	}
	handing.Wait()
	close(stop)
	workers.Wait()
}

func (h *batchHandler) meanBatch() float64 {
	return float64(h.msgs.Load()) / float64(max(h.batches.Load(), 1))
}

// BenchmarkInFlight measures what Concurrency (how many messages one
// Subscriber holds at once) and FetchBatch do for a handler that takes time:
// "delay" handles each message in its own goroutine and acks it after
// benchHandlerDelay; "batch" hands messages to a group commit in miniature
// (see batchHandler). b.N messages are stored first; only the draining is
// timed. It reports msgs/s, the ratio to Concurrency 1 with the same handler
// (x_conc1), the messages per pull request, and for "batch" the mean batch
// the handler saw. Run it with a fixed count:
// go test -run '^$' -bench InFlight -benchtime 4000x ./adapters/nats/
func BenchmarkInFlight(b *testing.B) {
	for _, mode := range []string{"delay", "batch"} {
		var base float64
		for _, c := range []struct{ conc, fetch int }{{1, 1}, {8, 1}, {64, 1}, {64, 16}, {256, 1}} {
			b.Run(fmt.Sprintf("handler=%s/concurrency=%d/fetch=%d", mode, c.conc, c.fetch), func(b *testing.B) {
				url := serverURL(b)
				topo := topology(namespace(b, url))
				topic := newTopic()
				nc := connect(b, url)

				pub, err := idemnats.NewPublisher(nc, idemnats.PublisherConfig{Topology: topo, MaxInFlight: 1024})
				require.NoError(b, err)
				defer func() { require.NoError(b, pub.Close()) }()
				sub, err := idemnats.NewSubscriber(nc, idemnats.SubscriberConfig{
					Topology: topo, Durable: "bench", Concurrency: c.conc, FetchBatch: c.fetch,
				})
				require.NoError(b, err)
				defer func() { require.NoError(b, sub.Close()) }()
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

				var h benchHandler = delayHandler{}
				if mode == "batch" {
					h = &batchHandler{}
				}
				ctx, cancel := context.WithCancel(context.Background())
				var done sync.WaitGroup
				done.Add(b.N)
				b.ResetTimer()
				msgs, err := sub.Subscribe(ctx, topic)
				require.NoError(b, err)
				handled := make(chan struct{})
				go func() {
					defer close(handled)
					h.run(msgs, &done)
				}()
				finished := make(chan struct{})
				go func() { done.Wait(); close(finished) }()
				select {
				case <-finished:
				case <-time.After(5 * time.Minute):
					b.Fatal("timed out")
				}
				b.StopTimer()
				cancel()
				<-handled

				rate := float64(b.N) / b.Elapsed().Seconds()
				b.ReportMetric(rate, "msgs/s")
				if c.conc == 1 {
					base = rate
				} else if base > 0 {
					b.ReportMetric(rate/base, "x_conc1")
				}
				st := sub.Stats()
				b.ReportMetric(float64(st.Pulled)/float64(max(st.Pulls, 1)), "msgs/pull")
				if mode == "batch" {
					b.ReportMetric(h.meanBatch(), "batch")
				}
				b.ReportMetric(0, "ns/op")
			})
		}
	}
}
