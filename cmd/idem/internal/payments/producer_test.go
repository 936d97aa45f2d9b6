package payments

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/adapters/nats"
	"github.com/idemkit/idem/chaos"
	"github.com/idemkit/idem/internal/pgtest"
)

// A producer that sends every message twice on NATS: the server's duplicate window
// drops the retries that carry Nats-Msg-Id, and every other retry goes without it,
// so half of them are stored and delivered, with the same UUID and payload as the
// original.
func TestNATSProducerSendsHalfTheRetriesPastTheWindow(t *testing.T) {
	t.Parallel()
	srv, err := StartNATS(t.TempDir(), -1)
	require.NoError(t, err)
	t.Cleanup(func() { srv.Shutdown(); srv.WaitForShutdown() })

	conn, err := Connect(Endpoint{Broker: NATS, Addr: srv.ClientURL(), Group: "producer-test"}, nil)
	require.NoError(t, err)
	t.Cleanup(conn.Close)
	pub, err := chaos.NewPublisher(conn.Publisher, chaos.PublisherConfig{DuplicateProbability: 1})
	require.NoError(t, err)
	const n = 10
	sent := map[string]string{}
	for range 2 { // two calls: a retry is a UUID published before, in this call or another
		batch := make([]*message.Message, 0, n/2)
		for i := range n / 2 {
			m := NewMessage(int64(i))
			sent[m.UUID] = string(m.Payload)
			batch = append(batch, m)
		}
		require.NoError(t, pub.Publish(Topic, batch...))
	}
	require.EqualValues(t, n, pub.Duplicates())
	require.EqualValues(t, n/2, conn.PastWindow())

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	msgs, err := conn.Subscriber.Subscribe(ctx, Topic)
	require.NoError(t, err)
	got := map[string]int{}
	for range n + n/2 {
		select {
		case m := <-msgs:
			require.Contains(t, sent, m.UUID)
			require.Equal(t, sent[m.UUID], string(m.Payload))
			got[m.UUID]++
			m.Ack()
		case <-ctx.Done():
			t.Fatalf("got %d deliveries of %d: %v", len(got), n+n/2, got)
		}
	}
	twice := 0
	for _, k := range got {
		twice += k - 1
	}
	require.Len(t, got, n)
	require.Equal(t, n/2, twice, "one delivery per message, and one more per retry past the window")
	// The stream holds the originals and the retries without Nats-Msg-Id, nothing else.
	pgtest.WaitFor(t, 30*time.Second, "the stream drained", func() bool {
		backlog, err := Backlog(ctx, Endpoint{Broker: NATS, Addr: srv.ClientURL(), Group: "producer-test"}, Topic)
		return err == nil && backlog == 0
	})
	info, err := conn.producer.js.Stream(ctx, nats.Topology{}.StreamOf(Topic))
	require.NoError(t, err)
	st, err := info.Info(ctx)
	require.NoError(t, err)
	require.EqualValues(t, n+n/2, st.State.Msgs)
}
