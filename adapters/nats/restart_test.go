package nats_test

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	idemnats "github.com/idemkit/idem/adapters/nats"
	"github.com/idemkit/idem/internal/pgtest"
)

// TestServerRestartKeepsAcksAndUnackedMessages stops the embedded server and
// starts it again on the same store: no acked message comes back, and no
// unacked one is lost, including one a handler held when the server went away.
// It always runs embedded, since it stops the server.
func TestServerRestartKeepsAcksAndUnackedMessages(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	srv := startEmbedded(t, dir, -1)
	url := srv.ClientURL()
	prefix := "idemtest_restart_"
	topo := topology(prefix)
	topic := newTopic()

	nc := connect(t, url)
	pub, err := idemnats.NewPublisher(nc, idemnats.PublisherConfig{Topology: topo})
	require.NoError(t, err)
	sub, err := idemnats.NewSubscriber(nc, idemnats.SubscriberConfig{
		Topology: topo, Durable: "restart", AckSync: true, Concurrency: 1,
		PullExpiry: 200 * time.Millisecond,
		Consumer:   jetstream.ConsumerConfig{AckWait: 2 * time.Second},
	})
	require.NoError(t, err)
	require.NoError(t, sub.SubscribeInitialize(topic))
	sent := publishN(t, pub, topic, 10)

	ctx, cancel := context.WithCancel(context.Background())
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	acked := map[string]bool{}
	for range 5 {
		m := receive(t, msgs, 30*time.Second)
		require.True(t, m.Ack())
		acked[m.UUID] = true
	}
	// The sixth message is in a handler when the server goes down.
	held := receive(t, msgs, 30*time.Second)
	pgtest.WaitFor(t, 30*time.Second, "double acks confirmed", func() bool { return sub.Stats().Acked == 5 })

	srv.Shutdown()
	srv.WaitForShutdown()
	cancel()
	held.Ack() // too late: the server is gone, so the ack is lost
	require.NoError(t, sub.Close())
	require.NoError(t, pub.Close())
	nc.Close()

	srv = startEmbedded(t, dir, -1)
	t.Cleanup(func() {
		srv.Shutdown()
		srv.WaitForShutdown()
	})
	nc = connect(t, srv.ClientURL())
	sub, err = idemnats.NewSubscriber(nc, idemnats.SubscriberConfig{
		Topology: topo, Durable: "restart", PullExpiry: 200 * time.Millisecond,
		Consumer: jetstream.ConsumerConfig{AckWait: 2 * time.Second},
	})
	require.NoError(t, err)
	defer func() { require.NoError(t, sub.Close()) }()
	msgs, err = sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)

	got := map[string]bool{}
	for range 5 {
		m := receive(t, msgs, 30*time.Second)
		assert.False(t, acked[m.UUID], "acked message %s came back", m.UUID)
		got[m.UUID] = true
		m.Ack()
	}
	nothing(t, msgs, 3*time.Second) // longer than AckWait: nothing else is owed
	for _, m := range sent {
		if !acked[m.UUID] {
			assert.True(t, got[m.UUID], "unacked message %s lost", m.UUID)
		}
	}
}

// TestSubscriberSurvivesServerRestart keeps one connection, Publisher and
// Subscriber across a restart of the server on the same port and store: the
// client reconnects, the pull loop resumes, and messages published after the
// restart arrive.
func TestSubscriberSurvivesServerRestart(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	srv := startEmbedded(t, dir, -1)
	port := srv.Addr().(*net.TCPAddr).Port
	topo := topology("idemtest_reconnect_")
	topic := newTopic()

	nc := connect(t, srv.ClientURL())
	pub, err := idemnats.NewPublisher(nc, idemnats.PublisherConfig{Topology: topo})
	require.NoError(t, err)
	defer func() { require.NoError(t, pub.Close()) }()
	sub, err := idemnats.NewSubscriber(nc, idemnats.SubscriberConfig{Topology: topo, Durable: "reconnect", PullExpiry: 200 * time.Millisecond})
	require.NoError(t, err)
	defer func() { require.NoError(t, sub.Close()) }()
	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)

	publishN(t, pub, topic, 1)
	receive(t, msgs, 30*time.Second).Ack()

	srv.Shutdown()
	srv.WaitForShutdown()
	srv = startEmbedded(t, dir, port)
	t.Cleanup(func() {
		srv.Shutdown()
		srv.WaitForShutdown()
	})
	pgtest.WaitFor(t, 30*time.Second, "the connection back", nc.IsConnected)

	after := message.NewMessage("after-restart", nil)
	pgtest.WaitFor(t, 30*time.Second, "a publish after the restart", func() bool { return pub.Publish(topic, after) == nil })
	got := receive(t, msgs, 30*time.Second)
	assert.Equal(t, "after-restart", got.UUID)
	got.Ack()
}
