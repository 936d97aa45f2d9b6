package kafka_test

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkit/idem/adapters/kafka"
)

// txnProducer is a transactional producer written by someone else: franz-go's
// client, as a Java or librdkafka producer would write (control markers at
// the end of every transaction, aborted transactions in the broker's index).
func txnProducer(t *testing.T, brokers []string, topic string) *kgo.Client {
	t.Helper()
	cl, err := kgo.NewClient(
		kgo.SeedBrokers(brokers...),
		kgo.TransactionalID("idem-test-"+uuid.NewString()),
		kgo.TransactionTimeout(time.Minute),
		kgo.DefaultProduceTopic(topic),
		kgo.RecordPartitioner(kgo.ManualPartitioner()),
	)
	require.NoError(t, err)
	t.Cleanup(cl.Close)
	return cl
}

func begin(t *testing.T, cl *kgo.Client) {
	t.Helper()
	require.NoError(t, cl.BeginTransaction())
}

func produce(t *testing.T, cl *kgo.Client, values ...string) {
	t.Helper()
	for _, v := range values {
		// Partition 0 through the manual partitioner: the test's only one.
		require.NoError(t, cl.ProduceSync(context.Background(), &kgo.Record{Value: []byte(v)}).FirstErr())
	}
}

func end(t *testing.T, cl *kgo.Client, commit bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, cl.EndTransaction(ctx, kgo.TransactionEndTry(commit)))
}

// plain publishes through this package's Publisher: a non-transactional
// record with a UUID, between the transactional ones.
func (b *testBundle) plain(t *testing.T, value string) {
	t.Helper()
	require.NoError(t, b.pub.Publish(b.topic, message.NewMessage(watermill.NewUUID(), []byte(value))))
}

// writeTransactions writes plain records and transactions of two producers,
// committed and aborted, interleaved, to the topic's only partition, and
// returns the values a consumer must see under each isolation level, in
// offset order. The partition ends with an abort marker.
func writeTransactions(t *testing.T, b *testBundle) (committed, uncommitted []string) {
	x := txnProducer(t, b.brokers, b.topic)
	y := txnProducer(t, b.brokers, b.topic)

	b.plain(t, "p1")
	begin(t, x)
	produce(t, x, "a1", "a2")
	end(t, x, true)
	b.plain(t, "p2")
	begin(t, x)
	produce(t, x, "b1", "b2")
	end(t, x, false)
	// Two transactions open at once, with a plain record between them.
	begin(t, y)
	produce(t, y, "y1")
	begin(t, x)
	produce(t, x, "c1")
	b.plain(t, "p3")
	produce(t, y, "y2")
	end(t, y, false)
	end(t, x, true)
	b.plain(t, "p4")
	begin(t, x)
	produce(t, x, "d1")
	end(t, x, false)

	return []string{"p1", "a1", "a2", "p2", "c1", "p3", "p4"},
		[]string{"p1", "a1", "a2", "p2", "b1", "b2", "y1", "c1", "p3", "y2", "p4", "d1"}
}

// Records of a transactional producer, committed and aborted, interleaved
// with plain ones: a consumer never gets a transaction marker, under
// ReadCommitted never an aborted record, and gets everything else in offset
// order. The offsets of markers and aborted records are committed as they
// are passed, so the group ends at the partition's end (no lag for ever,
// nothing delivered again after a restart). With 8 records in flight (and
// UnorderedWithoutKey, since these records have no key) the records come
// together and are acked in reverse, and the markers between them are still
// passed and committed.
func TestTransactionalProducer(t *testing.T) {
	t.Parallel()
	for _, level := range []struct {
		name  string
		level kafkago.IsolationLevel
	}{
		{"ReadCommitted", kafkago.ReadCommitted},
		{"ReadUncommitted", kafkago.ReadUncommitted},
	} {
		for _, inFlight := range []int{1, 8} {
			t.Run(fmt.Sprintf("%s/inflight=%d", level.name, inFlight), func(t *testing.T) {
				t.Parallel()
				forEachBroker(t, func(t *testing.T, brokers []string) {
					b := setup(t, brokers, 1)
					committed, uncommitted := writeTransactions(t, b)
					want := committed
					if level.level == kafkago.ReadUncommitted {
						want = uncommitted
					}

					cfg := subscriberConfig(b.brokers, b.group, 1)
					cfg.IsolationLevel = level.level
					cfg.MaxInFlightPerPartition = inFlight
					cfg.UnorderedWithoutKey = true
					sub, ch := b.subscribe(t, cfg)
					var got []string
					var offsets []int64
					mostAtOnce := 0
					for len(got) < len(want) {
						// Take what comes together, then ack it in reverse.
						batch := []*message.Message{receive(t, ch)}
						for more := inFlight > 1; more; {
							select {
							case msg := <-ch:
								batch = append(batch, msg)
							case <-time.After(300 * time.Millisecond):
								more = false
							}
						}
						mostAtOnce = max(mostAtOnce, len(batch))
						for i := len(batch) - 1; i >= 0; i-- {
							got = append(got, string(batch[i].Payload))
							offsets = append(offsets, offsetOf(t, batch[i]))
							batch[i].Ack()
						}
					}
					if inFlight > 1 {
						require.Greater(t, mostAtOnce, 1, "records came together")
						byOffset := map[int64]string{}
						for i, o := range offsets {
							byOffset[o] = got[i]
						}
						slices.Sort(offsets)
						got = got[:0]
						for _, o := range offsets {
							got = append(got, byOffset[o])
						}
					}
					require.Equal(t, want, got, "no marker, and no aborted record under ReadCommitted")
					assert.IsIncreasing(t, offsets)
					requireNothing(t, ch, time.Second)

					end := partitionEnd(t, b, level.level)
					requireCommitted(t, b, end)
					// Lag reads the high watermark, which counts the markers:
					// a group that passed them shows no lag.
					transport := &kafkago.Transport{}
					defer transport.CloseIdleConnections()
					lag, err := kafka.Lag(context.Background(), &kafkago.Client{Addr: kafkago.TCP(b.brokers...), Transport: transport, Timeout: 10 * time.Second}, b.group, b.topic)
					require.NoError(t, err)
					require.Zero(t, lag.Total, "lag after every record and marker is committed: %+v", lag)
					t.Logf("%s: delivered %d of the partition's %d offsets, at most %d at once; committed %d",
						level.name, len(got), end, mostAtOnce, end)
					require.NoError(t, sub.Close())

					// A new member starts at the end: nothing comes again.
					_, ch2 := b.subscribe(t, cfg)
					requireNothing(t, ch2, time.Second)
				})
			})
		}
	}
}

// Under ReadCommitted, records after an open transaction wait for its end,
// including plain ones: Kafka's last stable offset holds them back. Once the
// transaction commits, its records and the waiting ones come in offset order.
func TestReadCommittedWaitsForOpenTransaction(t *testing.T) {
	t.Parallel()
	forEachBroker(t, func(t *testing.T, brokers []string) {
		b := setup(t, brokers, 1)
		cfg := subscriberConfig(b.brokers, b.group, 1)
		cfg.IsolationLevel = kafkago.ReadCommitted
		_, ch := b.subscribe(t, cfg)

		x := txnProducer(t, b.brokers, b.topic)
		b.plain(t, "p1")
		msg := receive(t, ch)
		require.Equal(t, "p1", string(msg.Payload))
		msg.Ack()

		begin(t, x)
		produce(t, x, "t1")
		b.plain(t, "p2")
		requireNothing(t, ch, time.Second)
		end(t, x, true)
		for _, want := range []string{"t1", "p2"} {
			msg := receive(t, ch)
			require.Equal(t, want, string(msg.Payload))
			msg.Ack()
		}
		requireCommitted(t, b, partitionEnd(t, b, kafkago.ReadCommitted))
	})
}

func offsetOf(t *testing.T, msg *message.Message) int64 {
	t.Helper()
	off, err := strconv.ParseInt(msg.Metadata.Get(kafka.MetadataOffset), 10, 64)
	require.NoError(t, err)
	return off
}

// partitionEnd is partition 0's end for a consumer at level: its high
// watermark, or its last stable offset.
func partitionEnd(t *testing.T, b *testBundle, level kafkago.IsolationLevel) int64 {
	t.Helper()
	transport := &kafkago.Transport{}
	defer transport.CloseIdleConnections()
	c := &kafkago.Client{Addr: kafkago.TCP(b.brokers...), Transport: transport, Timeout: 10 * time.Second}
	res, err := c.ListOffsets(context.Background(), &kafkago.ListOffsetsRequest{
		Topics:         map[string][]kafkago.OffsetRequest{b.topic: {kafkago.LastOffsetOf(0)}},
		IsolationLevel: level,
	})
	require.NoError(t, err)
	require.Len(t, res.Topics[b.topic], 1)
	require.NoError(t, res.Topics[b.topic][0].Error)
	return res.Topics[b.topic][0].LastOffset
}

// requireCommitted waits until the group's committed offset of partition 0
// is want.
func requireCommitted(t *testing.T, b *testBundle, want int64) {
	t.Helper()
	transport := &kafkago.Transport{}
	defer transport.CloseIdleConnections()
	c := &kafkago.Client{Addr: kafkago.TCP(b.brokers...), Transport: transport, Timeout: 10 * time.Second}
	var last int64 = -1
	var lastErr error
	for deadline := time.Now().Add(receiveTimeout); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		res, err := c.OffsetFetch(context.Background(), &kafkago.OffsetFetchRequest{
			GroupID: b.group,
			Topics:  map[string][]int{b.topic: {0}},
		})
		if lastErr = err; err != nil || len(res.Topics[b.topic]) != 1 {
			continue
		}
		if last = res.Topics[b.topic][0].CommittedOffset; last == want {
			return
		}
	}
	t.Fatalf("the group's committed offset is %d, want %d (last error: %v)", last, want, lastErr)
}
