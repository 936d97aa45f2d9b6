package kafka_test

import (
	"context"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/protocol"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/idemkit/idem/adapters/kafka"
)

// lagBundle is a test's own topic and group, the kafka-go client Lag is
// given, and a franz-go client that writes records and deletes them
// (kafka-go has no DeleteRecords).
type lagBundle struct {
	topic, group string
	client       *kafkago.Client
	franz        *kgo.Client
	requests     *requestLog
}

// setupLag creates a topic of the given partitions and picks a group name,
// both the test's own and deleted at its end.
func setupLag(t *testing.T, brokers []string, partitions int) *lagBundle {
	t.Helper()
	b := &lagBundle{topic: "lag-" + uuid.NewString(), group: "lag-" + uuid.NewString(), requests: &requestLog{}}
	transport := &kafkago.Transport{}
	t.Cleanup(transport.CloseIdleConnections)
	b.requests.next = transport
	b.client = &kafkago.Client{Addr: kafkago.TCP(brokers...), Transport: b.requests, Timeout: 30 * time.Second}
	ctx := context.Background()
	res, err := b.client.CreateTopics(ctx, &kafkago.CreateTopicsRequest{Topics: []kafkago.TopicConfig{{
		Topic: b.topic, NumPartitions: partitions, ReplicationFactor: 1,
	}}})
	require.NoError(t, err)
	require.NoError(t, res.Errors[b.topic])
	t.Cleanup(func() {
		if _, err := b.client.DeleteGroups(ctx, &kafkago.DeleteGroupsRequest{GroupIDs: []string{b.group}}); err != nil {
			t.Logf("deleting the test's group %s: %v", b.group, err)
		}
		if _, err := b.client.DeleteTopics(ctx, &kafkago.DeleteTopicsRequest{Topics: []string{b.topic}}); err != nil {
			t.Logf("deleting the test's topic %s: %v", b.topic, err)
		}
	})
	b.franz, err = kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.DefaultProduceTopic(b.topic),
		kgo.RecordPartitioner(kgo.ManualPartitioner()))
	require.NoError(t, err)
	t.Cleanup(b.franz.Close)
	return b
}

// produce writes n records to partition p.
func (b *lagBundle) produce(t *testing.T, p, n int) {
	t.Helper()
	for i := range n {
		r := &kgo.Record{Partition: int32(p), Value: []byte(strconv.Itoa(i))}
		require.NoError(t, b.franz.ProduceSync(context.Background(), r).FirstErr())
	}
}

// commit commits offsets for the group, as a client outside any generation
// may (a group without members takes such commits).
func (b *lagBundle) commit(t *testing.T, offsets map[int]int64) {
	t.Helper()
	var commits []kafkago.OffsetCommit
	for p, o := range offsets {
		commits = append(commits, kafkago.OffsetCommit{Partition: p, Offset: o})
	}
	res, err := b.client.OffsetCommit(context.Background(), &kafkago.OffsetCommitRequest{
		GroupID: b.group, GenerationID: -1, Topics: map[string][]kafkago.OffsetCommit{b.topic: commits},
	})
	require.NoError(t, err)
	require.Len(t, res.Topics[b.topic], len(offsets))
	for _, p := range res.Topics[b.topic] {
		require.NoError(t, p.Error, "commit partition %d", p.Partition)
	}
}

// deleteBefore deletes the records of partition p before offset, as
// retention would.
func (b *lagBundle) deleteBefore(t *testing.T, p int, offset int64) {
	t.Helper()
	req := kmsg.NewPtrDeleteRecordsRequest()
	rt := kmsg.NewDeleteRecordsRequestTopic()
	rt.Topic = b.topic
	rp := kmsg.NewDeleteRecordsRequestTopicPartition()
	rp.Partition, rp.Offset = int32(p), offset
	rt.Partitions = append(rt.Partitions, rp)
	req.Topics = append(req.Topics, rt)
	req.TimeoutMillis = 30_000
	res, err := req.RequestWith(context.Background(), b.franz)
	require.NoError(t, err)
	require.Len(t, res.Topics, 1)
	require.Len(t, res.Topics[0].Partitions, 1)
	got := res.Topics[0].Partitions[0]
	require.NoError(t, kerr.ErrorForCode(got.ErrorCode), "delete records of partition %d", p)
	require.Equal(t, offset, got.LowWatermark)
}

func (b *lagBundle) lag(t *testing.T) kafka.GroupLag {
	t.Helper()
	lag, err := kafka.Lag(context.Background(), b.client, b.group, b.topic)
	require.NoError(t, err)
	require.Equal(t, b.group, lag.Group)
	require.Equal(t, b.topic, lag.Topic)
	return lag
}

// requestLog is a kafka-go RoundTripper that notes the requests it carries.
type requestLog struct {
	next kafkago.RoundTripper
	mu   sync.Mutex
	keys []string
}

func (l *requestLog) RoundTrip(ctx context.Context, addr net.Addr, req protocol.Message) (protocol.Message, error) {
	l.mu.Lock()
	l.keys = append(l.keys, req.ApiKey().String())
	l.mu.Unlock()
	return l.next.RoundTrip(ctx, addr, req)
}

func (l *requestLog) reset() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	keys := l.keys
	l.keys = nil
	return keys
}

// Lag gives each partition's first, end and committed offsets and the exact
// lag, in partition order, and their total: before the group commits (a group
// that does not exist yet counts from the first offset), after commits on
// some partitions, and zero once every record is committed. It goes through
// the client's own transport, where TLS and SASL would be.
func TestLag(t *testing.T) {
	t.Parallel()
	forEachBroker(t, func(t *testing.T, brokers []string) {
		b := setupLag(t, brokers, 3)
		b.produce(t, 0, 5)
		b.produce(t, 1, 3)

		b.requests.reset()
		lag := b.lag(t)
		require.Equal(t, []string{"Metadata", "ListOffsets", "OffsetFetch"}, b.requests.reset(),
			"Lag's requests go through the client's transport")
		require.Equal(t, []kafka.PartitionLag{
			{Partition: 0, FirstOffset: 0, EndOffset: 5, CommittedOffset: -1, Lag: 5},
			{Partition: 1, FirstOffset: 0, EndOffset: 3, CommittedOffset: -1, Lag: 3},
			{Partition: 2, FirstOffset: 0, EndOffset: 0, CommittedOffset: -1, Lag: 0},
		}, lag.Partitions)
		require.EqualValues(t, 8, lag.Total)

		b.commit(t, map[int]int64{0: 2, 1: 3})
		lag = b.lag(t)
		require.Equal(t, []kafka.PartitionLag{
			{Partition: 0, FirstOffset: 0, EndOffset: 5, CommittedOffset: 2, Lag: 3},
			{Partition: 1, FirstOffset: 0, EndOffset: 3, CommittedOffset: 3, Lag: 0},
			{Partition: 2, FirstOffset: 0, EndOffset: 0, CommittedOffset: -1, Lag: 0},
		}, lag.Partitions)
		require.EqualValues(t, 3, lag.Total)

		b.produce(t, 2, 2)
		b.commit(t, map[int]int64{0: 5, 2: 2})
		lag = b.lag(t)
		require.Equal(t, []kafka.PartitionLag{
			{Partition: 0, FirstOffset: 0, EndOffset: 5, CommittedOffset: 5, Lag: 0},
			{Partition: 1, FirstOffset: 0, EndOffset: 3, CommittedOffset: 3, Lag: 0},
			{Partition: 2, FirstOffset: 0, EndOffset: 2, CommittedOffset: 2, Lag: 0},
		}, lag.Partitions)
		require.Zero(t, lag.Total)
	})
}

// Records deleted before the group read them (retention, here DeleteRecords)
// do not count: a partition without a commit counts from its first retained
// offset, not from 0, and so does a committed offset that was deleted since.
func TestLagAfterRecordsDeleted(t *testing.T) {
	t.Parallel()
	forEachBroker(t, func(t *testing.T, brokers []string) {
		b := setupLag(t, brokers, 3)
		b.produce(t, 0, 6)
		b.produce(t, 1, 6)
		b.produce(t, 2, 6)
		b.commit(t, map[int]int64{1: 2, 2: 5})
		b.deleteBefore(t, 0, 4)
		b.deleteBefore(t, 1, 4)
		b.deleteBefore(t, 2, 4)

		lag := b.lag(t)
		require.Equal(t, []kafka.PartitionLag{
			{Partition: 0, FirstOffset: 4, EndOffset: 6, CommittedOffset: -1, Lag: 2}, // no commit
			{Partition: 1, FirstOffset: 4, EndOffset: 6, CommittedOffset: 2, Lag: 2},  // commit deleted since
			{Partition: 2, FirstOffset: 4, EndOffset: 6, CommittedOffset: 5, Lag: 1},
		}, lag.Partitions)
		require.EqualValues(t, 5, lag.Total)
	})
}

// A topic that does not exist is an error that names it and matches the
// broker's code, and Lag does not create it.
func TestLagUnknownTopic(t *testing.T) {
	t.Parallel()
	forEachBroker(t, func(t *testing.T, brokers []string) {
		b := setupLag(t, brokers, 1)
		missing := "lag-missing-" + uuid.NewString()
		_, err := kafka.Lag(context.Background(), b.client, b.group, missing)
		require.ErrorIs(t, err, kafkago.UnknownTopicOrPartition)
		require.ErrorContains(t, err, "topic "+missing)

		transport := &kafkago.Transport{}
		defer transport.CloseIdleConnections()
		fresh := &kafkago.Client{Addr: kafkago.TCP(brokers...), Transport: transport, Timeout: 30 * time.Second}
		md, err := fresh.Metadata(context.Background(), &kafkago.MetadataRequest{Topics: []string{missing}})
		require.NoError(t, err)
		require.Len(t, md.Topics, 1)
		require.ErrorIs(t, md.Topics[0].Error, kafkago.UnknownTopicOrPartition, "Lag created the topic")
	})
}

// Errors the broker gives for one partition or for the group come back with
// the partition or group named and the broker's code wrapped. A real broker
// gives them rarely (a leader moving, a missing ACL), so kfake is made to.
func TestLagBrokerErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		key     kmsg.Key
		respond func(kmsg.Request) kmsg.Response
		want    kafkago.Error
		names   string
	}{
		{
			name: "list-offsets-partition", key: kmsg.ListOffsets, want: kafkago.NotLeaderForPartition, names: "partition 1",
			respond: func(r kmsg.Request) kmsg.Response {
				req := r.(*kmsg.ListOffsetsRequest)
				res := req.ResponseKind().(*kmsg.ListOffsetsResponse)
				for _, rt := range req.Topics {
					t := kmsg.NewListOffsetsResponseTopic()
					t.Topic = rt.Topic
					for _, rp := range rt.Partitions {
						p := kmsg.NewListOffsetsResponseTopicPartition()
						p.Partition = rp.Partition
						if rp.Partition == 1 {
							p.ErrorCode = kerr.NotLeaderForPartition.Code
						}
						t.Partitions = append(t.Partitions, p)
					}
					res.Topics = append(res.Topics, t)
				}
				return res
			},
		},
		{
			name: "group", key: kmsg.OffsetFetch, want: kafkago.GroupAuthorizationFailed, names: "group ",
			respond: func(r kmsg.Request) kmsg.Response {
				res := r.(*kmsg.OffsetFetchRequest).ResponseKind().(*kmsg.OffsetFetchResponse)
				res.ErrorCode = kerr.GroupAuthorizationFailed.Code
				return res
			},
		},
		{
			name: "offset-fetch-partition", key: kmsg.OffsetFetch, want: kafkago.TopicAuthorizationFailed, names: "partition 2",
			respond: func(r kmsg.Request) kmsg.Response {
				req := r.(*kmsg.OffsetFetchRequest)
				res := req.ResponseKind().(*kmsg.OffsetFetchResponse)
				for _, rt := range req.Topics {
					t := kmsg.NewOffsetFetchResponseTopic()
					t.Topic = rt.Topic
					for _, id := range rt.Partitions {
						p := kmsg.NewOffsetFetchResponseTopicPartition()
						p.Partition, p.Offset = id, -1
						if id == 2 {
							p.ErrorCode = kerr.TopicAuthorizationFailed.Code
						}
						t.Partitions = append(t.Partitions, p)
					}
					res.Topics = append(res.Topics, t)
				}
				return res
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cluster, err := kfake.NewCluster(kfake.NumBrokers(1))
			require.NoError(t, err)
			t.Cleanup(cluster.Close)
			b := setupLag(t, cluster.ListenAddrs(), 3)
			b.produce(t, 1, 2)
			cluster.ControlKey(int16(tc.key), func(r kmsg.Request) (kmsg.Response, error, bool) {
				cluster.KeepControl()
				res := tc.respond(r)
				res.SetVersion(r.GetVersion())
				return res, nil, true
			})
			_, err = kafka.Lag(context.Background(), b.client, b.group, b.topic)
			require.ErrorIs(t, err, tc.want)
			require.ErrorContains(t, err, tc.names)
			require.ErrorContains(t, err, b.group)
			require.ErrorContains(t, err, b.topic)
		})
	}
}

// Lag gives up when its context's deadline passes, here on a broker that
// accepts connections and never answers.
func TestLagHonoursDeadline(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var conns sync.WaitGroup
	var mu sync.Mutex
	var open []net.Conn
	conns.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			open = append(open, c)
			mu.Unlock()
		}
	})
	defer func() {
		_ = ln.Close()
		conns.Wait()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range open {
			_ = c.Close()
		}
	}()
	transport := &kafkago.Transport{}
	defer transport.CloseIdleConnections()
	client := &kafkago.Client{Addr: kafkago.TCP(ln.Addr().String()), Transport: transport}

	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := kafka.Lag(ctx, client, "g", "t")
		done <- err
	}()
	select {
	case err := <-done:
		require.ErrorIs(t, err, context.DeadlineExceeded)
	case <-time.After(30 * time.Second):
		t.Fatal("Lag did not return 30 s after its context's deadline of 200 ms")
	}

	expired, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = kafka.Lag(expired, client, "g", "t")
	require.ErrorIs(t, err, context.Canceled)
}
