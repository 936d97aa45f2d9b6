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
