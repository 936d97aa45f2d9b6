package payments

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/idemkit/idem/internal/pgtest"
)

// On Kafka, Backlog is the group's lag: every record of the topic before the
// group commits anything, and 0 once its member has acked them all and the
// acks are committed.
func TestKafkaBacklogIsTheGroupsLag(t *testing.T) {
	t.Parallel()
	c, err := StartKafka()
	require.NoError(t, err)
	t.Cleanup(c.Close)
	e := Endpoint{Broker: Kafka, Addr: strings.Join(c.ListenAddrs(), ","), Group: "backlog-test"}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	conn, err := Connect(e, nil)
	require.NoError(t, err)
	t.Cleanup(conn.Close)
	const n = 12
	for i := range n {
		require.NoError(t, conn.Publisher.Publish(Topic, NewMessage(int64(i))))
	}
	backlog, err := Backlog(ctx, e, Topic)
	require.NoError(t, err)
	require.EqualValues(t, n, backlog)

	msgs, err := conn.Subscriber.Subscribe(ctx, Topic)
	require.NoError(t, err)
	for range n {
		select {
		case m := <-msgs:
			m.Ack()
		case <-ctx.Done():
			t.Fatal("the group did not get every message within a minute")
		}
	}
	pgtest.WaitFor(t, time.Minute, "a backlog of 0", func() bool {
		backlog, err := Backlog(ctx, e, Topic)
		require.NoError(t, err)
		return backlog == 0
	})
}

// On a broker whose group.min.session.timeout.ms is above the chaos runs' 1 s
// session (a stock broker's is 6 s), the consumers ask for the broker's floor
// instead of being refused, so the group forms and messages flow.
func TestConsumersJoinABrokerWithALongerSessionFloor(t *testing.T) {
	t.Parallel()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(Partitions, Topic),
		kfake.BrokerConfigs(map[string]string{"group.min.session.timeout.ms": "3000"}))
	require.NoError(t, err)
	t.Cleanup(c.Close)
	t.Logf("broker: in-process kfake, group.min.session.timeout.ms=3000")
	brokers := c.ListenAddrs()

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	floor, err := SessionFloor(ctx, brokers, Topic)
	require.NoError(t, err)
	require.Equal(t, 3*time.Second, floor)
	session, heartbeat := sessionFor(brokers, Topic)
	require.Equal(t, 3*time.Second, session)
	require.Equal(t, 300*time.Millisecond, heartbeat)

	conn, err := Connect(Endpoint{Broker: Kafka, Addr: strings.Join(brokers, ","), Group: "floor-test"}, nil)
	require.NoError(t, err)
	t.Cleanup(conn.Close)
	msgs, err := conn.Subscriber.Subscribe(ctx, Topic)
	require.NoError(t, err)
	sent := NewMessage(1)
	require.NoError(t, conn.Publisher.Publish(Topic, sent))
	select {
	case got := <-msgs:
		require.Equal(t, sent.UUID, got.UUID)
		got.Ack()
	case <-ctx.Done():
		t.Fatal("no message within a minute: the group never formed")
	}
}

// The broker of KAFKA_BROKERS (scripts/services, docker-compose) lets test
// groups ask for 1 s sessions.
func TestSessionFloorOfTheTestBroker(t *testing.T) {
	t.Parallel()
	b := os.Getenv("KAFKA_BROKERS")
	if b == "" {
		t.Log("broker: KAFKA_BROKERS is not set; asking an in-process kfake with the option the test broker sets")
		c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, Topic),
			kfake.BrokerConfigs(map[string]string{"group.min.session.timeout.ms": "1000"}))
		require.NoError(t, err)
		t.Cleanup(c.Close)
		b = strings.Join(c.ListenAddrs(), ",")
	} else {
		t.Logf("broker: Kafka at %s (KAFKA_BROKERS)", b)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	floor, err := SessionFloor(ctx, strings.Split(b, ","), Topic)
	require.NoError(t, err)
	require.Equal(t, time.Second, floor)
}

// The in-process broker reports the floor it enforces, so the chaos runs on it
// keep their 1 s sessions.
func TestStartKafkaReportsItsSessionFloor(t *testing.T) {
	t.Parallel()
	c, err := StartKafka()
	require.NoError(t, err)
	t.Cleanup(c.Close)
	t.Logf("broker: in-process kfake")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	floor, err := SessionFloor(ctx, c.ListenAddrs(), Topic)
	require.NoError(t, err)
	require.Equal(t, 100*time.Millisecond, floor)
	session, heartbeat := sessionFor(c.ListenAddrs(), Topic)
	require.Equal(t, kafkaSession, session)
	require.Equal(t, kafkaHeartbeat, heartbeat)
}
