package benchkit

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// A CreateTopics request whose connection the broker drops is sent again, and
// the topic is made once; a topic that exists before the first request is
// still refused.
func TestCreateTopicRetriesALostConnection(t *testing.T) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1))
	require.NoError(t, err)
	t.Cleanup(c.Close)
	var calls atomic.Int64
	c.ControlKey(int16(kmsg.CreateTopics), func(kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		if calls.Add(1) == 1 {
			return nil, errors.New("connection dropped by the test"), true
		}
		return nil, nil, false
	})
	client := &kafkago.Client{Addr: kafkago.TCP(c.ListenAddrs()...), Timeout: 10 * time.Second}
	ctx := context.Background()
	require.NoError(t, createTopic(ctx, client, "lost-once", 2))
	require.Equal(t, int64(2), calls.Load(), "the dropped request was sent again")

	err = createTopic(ctx, client, "lost-once", 2)
	require.ErrorIs(t, err, kafkago.TopicAlreadyExists, "a topic that exists before the first request is not this run's")
}

// waitCommitted returns once the group has committed the end of every
// partition, and not while one partition is behind.
func TestWaitCommittedWaitsForEveryPartition(t *testing.T) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1))
	require.NoError(t, err)
	t.Cleanup(c.Close)
	client := &kafkago.Client{Addr: kafkago.TCP(c.ListenAddrs()...), Timeout: 10 * time.Second}
	ctx := context.Background()
	const topic = "wait-committed"
	require.NoError(t, createTopic(ctx, client, topic, 2))
	for p, n := range []int{3, 2} {
		records := make([]kafkago.Record, n)
		for i := range records {
			records[i].Value = kafkago.NewBytes([]byte("r"))
		}
		res, err := client.Produce(ctx, &kafkago.ProduceRequest{Topic: topic, Partition: p,
			RequiredAcks: kafkago.RequireAll, Records: kafkago.NewRecordReader(records...)})
		require.NoError(t, err)
		require.NoError(t, res.Error)
	}
	commit := func(p int, offset int64) {
		t.Helper()
		res, err := client.OffsetCommit(ctx, &kafkago.OffsetCommitRequest{GroupID: topic, GenerationID: -1,
			Topics: map[string][]kafkago.OffsetCommit{topic: {{Partition: p, Offset: offset}}}})
		require.NoError(t, err)
		require.NoError(t, res.Topics[topic][0].Error)
	}

	commit(0, 3)
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, waitCommitted(short, client, topic, 2), context.DeadlineExceeded,
		"partition 1 is 2 records behind")

	commit(1, 2)
	require.NoError(t, waitCommitted(ctx, client, topic, 2))
}
