package kafka_test

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
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
// docs/benchmarks.md compares with Watermill's "Subscribe (messages / s)".
func BenchmarkSubscribeAck(b *testing.B) {
	brokers := externalBrokers()
	if brokers == nil {
		brokers = startCluster(b)
	}
	for _, partitions := range []int{1, 4, 16} {
		b.Run(fmt.Sprintf("partitions=%d", partitions), func(b *testing.B) {
			topic, group := "bench-"+uuid.NewString(), "bench-"+uuid.NewString()
			dropTopicsAtEnd(b, brokers, func() []string { return []string{topic} })
			cfg := subscriberConfig(brokers, group, partitions)
			init := newSubscriber(b, cfg)
			require.NoError(b, init.SubscribeInitialize(topic))
			require.NoError(b, init.Close())

			pub := newPublisher(b, brokers, nil)
			batch := make([]*message.Message, 0, 1000)
			for i := range b.N {
				batch = append(batch, message.NewMessage(watermill.NewUUID(), payload16))
				if len(batch) == cap(batch) || i == b.N-1 {
					require.NoError(b, pub.Publish(topic, batch...))
					batch = batch[:0]
				}
			}
			require.NoError(b, pub.Close())

			sub := newSubscriber(b, cfg)
			defer func() { require.NoError(b, sub.Close()) }()
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
	dropTopicsAtEnd(b, brokers, func() []string { return []string{topic} })
	init := newSubscriber(b, subscriberConfig(brokers, "", 4))
	require.NoError(b, init.SubscribeInitialize(topic))
	require.NoError(b, init.Close())
	pub := newPublisher(b, brokers, nil)
	defer func() { require.NoError(b, pub.Close()) }()

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
			select {
			case reqs <- m:
			case <-m.Context().Done(): // revoked or closed
			}
		}()
	}
	handing.Wait()
	close(stop)
	workers.Wait()
}

func (h *batchHandler) meanBatch() float64 {
	return float64(h.msgs.Load()) / float64(max(h.batches.Load(), 1))
}

// BenchmarkInFlight measures what MaxInFlightPerPartition does for a handler
// that takes time, on a topic of 4 partitions whose records have distinct
// keys: "delay" handles each message in its own goroutine and acks it after
// benchHandlerDelay; "batch" hands messages to a group commit in miniature
// (see batchHandler). b.N records are in the topic first; the timer runs from
// Subscribe to the last ack. It reports msgs/s, the ratio to 1 in flight with
// the same handler (x_inflight1), and for "batch" the mean batch the handler
// saw. On kfake each run has a cluster of its own. Run it with a fixed count:
// go test -run '^$' -bench InFlight -benchtime 4000x ./adapters/kafka/
func BenchmarkInFlight(b *testing.B) {
	const partitions = 4
	for _, mode := range []string{"delay", "batch"} {
		var base float64
		for _, n := range []int{1, 8, 64} {
			b.Run(fmt.Sprintf("handler=%s/inflight=%d", mode, n), func(b *testing.B) {
				brokers := externalBrokers()
				if brokers == nil {
					brokers = startCluster(b) // a fresh one: kfake keeps every record in memory
				}
				topic, group := "bench-"+uuid.NewString(), "bench-"+uuid.NewString()
				cfg := subscriberConfig(brokers, group, partitions)
				cfg.MaxInFlightPerPartition = n
				init := newSubscriber(b, cfg)
				require.NoError(b, init.SubscribeInitialize(topic))
				require.NoError(b, init.Close())

				pub := newPublisher(b, brokers, kafka.PartitionKeyFromMetadata("key"))
				batch := make([]*message.Message, 0, 1000)
				for i := range b.N {
					msg := message.NewMessage(watermill.NewUUID(), payload16)
					msg.Metadata.Set("key", strconv.Itoa(i))
					batch = append(batch, msg)
					if len(batch) == cap(batch) || i == b.N-1 {
						require.NoError(b, pub.Publish(topic, batch...))
						batch = batch[:0]
					}
				}
				require.NoError(b, pub.Close())

				var h benchHandler = delayHandler{}
				if mode == "batch" {
					h = &batchHandler{}
				}
				sub := newSubscriber(b, cfg)
				var done sync.WaitGroup
				done.Add(b.N)
				b.ResetTimer()
				ch, err := sub.Subscribe(context.Background(), topic)
				require.NoError(b, err)
				handled := make(chan struct{})
				go func() {
					defer close(handled)
					h.run(ch, &done)
				}()
				finished := make(chan struct{})
				go func() { done.Wait(); close(finished) }()
				select {
				case <-finished:
				case <-time.After(5 * time.Minute):
					b.Fatal("timed out")
				}
				b.StopTimer()
				require.NoError(b, sub.Close())
				<-handled

				rate := float64(b.N) / b.Elapsed().Seconds()
				b.ReportMetric(rate, "msgs/s")
				if n == 1 {
					base = rate
				} else if base > 0 {
					b.ReportMetric(rate/base, "x_inflight1")
				}
				if mode == "batch" {
					b.ReportMetric(h.meanBatch(), "batch")
				}
				b.ReportMetric(0, "ns/op")
			})
		}
	}
}
