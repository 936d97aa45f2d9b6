package benchkit_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/idemkit/idem/cmd/idem/internal/benchkit"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/pgtest"
)

// externalBrokers returns KAFKA_BROKERS split on commas, or nil.
func externalBrokers() []string {
	if v := os.Getenv("KAFKA_BROKERS"); v != "" {
		return strings.Split(v, ",")
	}
	return nil
}

// TestKafkaSetup runs the kfake setup small: every record handled once into the
// business table, duplicates (producer retries) suppressed, every offset
// committed, and the broker named.
func TestKafkaSetup(t *testing.T) {
	t.Parallel()
	_, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 2})
	ctx := context.Background()
	o := benchkit.Options{DatabaseURL: pgtest.URL(), Schema: schema, N: 400, DupRate: 0.3,
		KafkaPartitions: 4, KafkaInFlight: 16}
	require.NoError(t, benchkit.Prepare(ctx, o))
	res, err := benchkit.Run(ctx, benchkit.Kafka, o)
	require.NoError(t, err)
	t.Logf("%s: %.0f msgs/s p50 %v p99 %v round trips/msg %.2f, topic %s", res.Broker, res.MsgsPerSec, res.P50, res.P99, res.TripsPerMsg, res.Topic)
	require.Contains(t, res.Broker, "kfake")
	require.True(t, strings.HasPrefix(res.Topic, benchkit.TopicPrefix), res.Topic)
	require.Zero(t, res.Lost)
	require.Zero(t, res.CommittedTwice)
	require.Equal(t, 400, res.BusinessRows)
	require.Greater(t, res.Deliveries, 400, "30% of the records are produced twice")
	require.Positive(t, res.P50)
	require.Less(t, res.TripsPerMsg, 1.0, "the batch handler")
}

// TestKafkaExternal runs the kafka-external setup on a broker that already holds
// a topic and a group of someone else's: on a kfake cluster of the test's own
// (always), and on KAFKA_BROKERS when set. The setup must lose nothing, commit
// nothing twice, delete the topic and the group it made, and leave the other
// topic, its records and its group's offsets as they were.
func TestKafkaExternal(t *testing.T) {
	t.Parallel()
	t.Run("kfake", func(t *testing.T) {
		t.Parallel()
		c, err := kfake.NewCluster(kfake.NumBrokers(1),
			kfake.BrokerConfigs(map[string]string{"group.min.session.timeout.ms": "100"}))
		require.NoError(t, err)
		t.Cleanup(c.Close)
		testExternal(t, c.ListenAddrs(), true)
	})
	if brokers := externalBrokers(); brokers != nil {
		t.Run("external="+strings.Join(brokers, ","), func(t *testing.T) {
			t.Parallel()
			testExternal(t, brokers, false)
		})
	} else {
		t.Log("KAFKA_BROKERS is not set: run on kfake only")
	}
}

func testExternal(t *testing.T, brokers []string, private bool) {
	ctx := context.Background()
	client := &kafkago.Client{Addr: kafkago.TCP(brokers...), Timeout: 30 * time.Second}
	// Someone else's topic, with records and a group's committed offset; its name
	// shares the setup's prefix, which must not matter.
	other := benchkit.TopicPrefix + "other-" + consumer.NewUUID()
	cr, err := client.CreateTopics(ctx, &kafkago.CreateTopicsRequest{Topics: []kafkago.TopicConfig{{
		Topic: other, NumPartitions: 2, ReplicationFactor: -1}}})
	require.NoError(t, err)
	require.NoError(t, cr.Errors[other])
	t.Cleanup(func() {
		_, _ = client.DeleteGroups(context.Background(), &kafkago.DeleteGroupsRequest{GroupIDs: []string{other}})
		_, _ = client.DeleteTopics(context.Background(), &kafkago.DeleteTopicsRequest{Topics: []string{other}})
	})
	// kafka-go's Writer waits for no acknowledgement unless told: a broker that has
	// just started can drop records sent before the new topic's leaders are ready.
	w := &kafkago.Writer{Addr: kafkago.TCP(brokers...), Topic: other, Balancer: &kafkago.RoundRobin{},
		BatchTimeout: time.Millisecond, RequiredAcks: kafkago.RequireAll}
	require.NoError(t, w.WriteMessages(ctx, kafkago.Message{Value: []byte("a")}, kafkago.Message{Value: []byte("b")},
		kafkago.Message{Value: []byte("c")}))
	require.NoError(t, w.Close())
	// The other group commits one record: a reader of its own reads and commits it.
	r := kafkago.NewReader(kafkago.ReaderConfig{Brokers: brokers, Topic: other, GroupID: other,
		HeartbeatInterval: 100 * time.Millisecond, SessionTimeout: 6 * time.Second, MaxWait: 100 * time.Millisecond})
	rctx, cancel := context.WithTimeout(ctx, time.Minute)
	m, err := r.FetchMessage(rctx)
	require.NoError(t, err)
	require.NoError(t, r.CommitMessages(rctx, m))
	cancel()
	require.NoError(t, r.Close())
	before := otherState(t, client, other)
	topicsBefore := topics(t, client)

	_, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 2})
	o := benchkit.Options{DatabaseURL: pgtest.URL(), Schema: schema, N: 300, DupRate: 0.2,
		KafkaBrokers: brokers, KafkaPartitions: 4, KafkaInFlight: 16}
	require.NoError(t, benchkit.Prepare(ctx, o))
	res, err := benchkit.Run(ctx, benchkit.KafkaExternal, o)
	require.NoError(t, err)
	t.Logf("%s: %.0f msgs/s p50 %v p99 %v, topic %s", res.Broker, res.MsgsPerSec, res.P50, res.P99, res.Topic)
	require.Equal(t, "Kafka at "+strings.Join(brokers, ","), res.Broker)
	require.Zero(t, res.Lost)
	require.Zero(t, res.CommittedTwice)
	require.Greater(t, res.Deliveries, 300)

	// The run's topic and group are gone (a real broker deletes a topic
	// asynchronously: wait for it).
	pgtest.WaitFor(t, 30*time.Second, fmt.Sprintf("topic %s is still there", res.Topic), func() bool { return !slices.Contains(topics(t, client), res.Topic) })
	lg, err := client.ListGroups(ctx, &kafkago.ListGroupsRequest{})
	require.NoError(t, err)
	for _, g := range lg.Groups {
		require.NotEqual(t, res.Topic, g.GroupID, "the run's group is still there")
	}
	// The other topic, its records and its group's offsets are as they were.
	require.Equal(t, before, otherState(t, client, other))
	after := topics(t, client)
	require.Contains(t, after, other)
	if private {
		// Nobody else uses this cluster: the topics are exactly those before.
		require.ElementsMatch(t, topicsBefore, after)
	}
}

// listLastOffsets reads the end offsets of topic's two partitions into s[0:2].
func listLastOffsets(ctx context.Context, client *kafkago.Client, topic string, s *[4]int64) error {
	lo, err := client.ListOffsets(ctx, &kafkago.ListOffsetsRequest{Topics: map[string][]kafkago.OffsetRequest{
		topic: {kafkago.LastOffsetOf(0), kafkago.LastOffsetOf(1)}}})
	if err != nil {
		return err
	}
	if len(lo.Topics[topic]) != 2 {
		return fmt.Errorf("%d partitions answered, want 2", len(lo.Topics[topic]))
	}
	for _, p := range lo.Topics[topic] {
		if p.Error != nil {
			return fmt.Errorf("partition %d: %w", p.Partition, p.Error)
		}
		s[p.Partition] = p.LastOffset
	}
	return nil
}

// otherState is the end offsets and the group's committed offsets of topic's two
// partitions.
func otherState(t *testing.T, client *kafkago.Client, topic string) [4]int64 {
	t.Helper()
	ctx := context.Background()
	var s [4]int64
	// A broker that has just started (CI's) can answer a partition of a new topic
	// with a transient error ("unexpected server error"): ask again until each
	// partition answers, for a while.
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		err := listLastOffsets(ctx, client, topic, &s)
		if err == nil {
			break
		}
		require.True(t, time.Now().Before(deadline), "list offsets of %s: %v", topic, err)
	}
	of, err := client.OffsetFetch(ctx, &kafkago.OffsetFetchRequest{GroupID: topic, Topics: map[string][]int{topic: {0, 1}}})
	require.NoError(t, err)
	for _, p := range of.Topics[topic] {
		require.NoError(t, p.Error)
		s[2+p.Partition] = p.CommittedOffset
	}
	require.ElementsMatch(t, []int64{1, -1}, s[2:], "the other group's commit: one partition at offset 1, the other none")
	require.Equal(t, int64(3), s[0]+s[1], "the other topic's records")
	return s
}

func topics(t *testing.T, client *kafkago.Client) []string {
	t.Helper()
	md, err := client.Metadata(context.Background(), &kafkago.MetadataRequest{})
	require.NoError(t, err)
	var out []string
	for _, tp := range md.Topics {
		if !tp.Internal {
			out = append(out, tp.Name)
		}
	}
	return out
}
