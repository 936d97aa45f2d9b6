package kafka_test

import (
	"context"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/idemkit/idem/adapters/kafka"
)

// A SessionTimeout outside the broker's bounds is refused with error 26
// (INVALID_SESSION_TIMEOUT) on every attempt. Subscribe fails at once with a
// GroupRefusedError that names the broker's bound and what to set, instead
// of retrying in silence for ever.
func TestSessionTimeoutRefused(t *testing.T) {
	t.Parallel()
	forEachBroker(t, func(t *testing.T, brokers []string) {
		b := setup(t, brokers, 1)
		for _, tc := range []struct {
			name            string
			session, beat   time.Duration
			config, compare string
		}{
			// Below any broker's floor (Kafka's default is 6 s; the test
			// brokers allow 100 ms and 1 s).
			{"below group.min.session.timeout.ms", 10 * time.Millisecond, 3 * time.Millisecond, "group.min.session.timeout.ms", ">="},
			// Above Kafka's default ceiling (30 min; kfake's is 5 min).
			{"above group.max.session.timeout.ms", 2 * time.Hour, time.Second, "group.max.session.timeout.ms", "<="},
		} {
			t.Run(tc.name, func(t *testing.T) {
				cfg := subscriberConfig(b.brokers, b.group, 1)
				cfg.SessionTimeout, cfg.HeartbeatInterval = tc.session, tc.beat
				logs := newCaptureLogger()
				cfg.Logger = logs
				sub := newSubscriber(t, cfg)
				defer func() { require.NoError(t, sub.Close()) }()

				start := time.Now()
				ch, err := sub.Subscribe(context.Background(), b.topic)
				require.Error(t, err)
				require.Nil(t, ch)
				t.Logf("refused after %s: %v", time.Since(start).Round(time.Millisecond), err)
				assert.ErrorIs(t, err, kafka.ErrGroupRefused)
				assert.ErrorIs(t, err, kafkago.InvalidSessionTimeout)
				var refused *kafka.GroupRefusedError
				require.ErrorAs(t, err, &refused)
				assert.Equal(t, kafka.CodeGroupRefused, refused.Code())

				m := regexp.MustCompile(`broker ` + regexp.QuoteMeta(tc.config) + ` is (\d+) \(([^)]+)\); SessionTimeout is ` +
					regexp.QuoteMeta(tc.session.String()) + `: set SessionTimeout ` + tc.compare + ` (\S+)`).FindStringSubmatch(err.Error())
				require.NotNil(t, m, "the error names the broker's bound and what to set: %v", err)
				bound, _ := strconv.Atoi(m[1])
				if tc.compare == ">=" {
					assert.Greater(t, time.Duration(bound)*time.Millisecond, tc.session)
				} else {
					assert.Less(t, time.Duration(bound)*time.Millisecond, tc.session)
				}
				assert.True(t, logs.has("Consumer group refused this member"), "the refusal is logged at error level too")
			})
		}
	})
}

// A refusal after the member has joined (here: the broker's floor raised,
// then a rebalance makes the member rejoin) ends the subscription: an error
// log with the refusal, and the channel closes. kfake only: Kafka cannot
// change group.min.session.timeout.ms at run time (it is a static broker
// config), kfake can.
func TestRefusalAfterJoinEndsSubscription(t *testing.T) {
	t.Parallel()
	c, err := kfake.NewCluster(kfake.NumBrokers(1),
		kfake.BrokerConfigs(map[string]string{"group.min.session.timeout.ms": "100"}))
	require.NoError(t, err)
	t.Cleanup(c.Close)
	brokers := c.ListenAddrs()
	t.Logf("Kafka broker: kfake, in process, at %s (kfake only: the test changes a static broker config)", strings.Join(brokers, ","))
	b := setup(t, brokers, 2)

	cfg := subscriberConfig(brokers, b.group, 2)
	logs := newCaptureLogger()
	cfg.Logger = logs
	_, ch := b.subscribe(t, cfg)

	transport := &kafkago.Transport{}
	defer transport.CloseIdleConnections()
	admin := &kafkago.Client{Addr: kafkago.TCP(brokers...), Transport: transport, Timeout: 10 * time.Second}
	res, err := admin.IncrementalAlterConfigs(context.Background(), &kafkago.IncrementalAlterConfigsRequest{
		Resources: []kafkago.IncrementalAlterConfigsRequestResource{{
			ResourceType: kafkago.ResourceTypeBroker,
			ResourceName: "0",
			Configs: []kafkago.IncrementalAlterConfigsRequestConfig{{
				Name: "group.min.session.timeout.ms", Value: "5000", ConfigOperation: kafkago.ConfigOperationSet,
			}},
		}},
	})
	require.NoError(t, err)
	for _, r := range res.Resources {
		require.NoError(t, r.Error)
	}

	// A member that the new floor accepts joins, so the first one rejoins.
	cfg2 := subscriberConfig(brokers, b.group, 2)
	cfg2.SessionTimeout, cfg2.HeartbeatInterval = 6*time.Second, time.Second
	b.subscribe(t, cfg2)

	select {
	case _, open := <-drain(ch):
		require.False(t, open)
	case <-time.After(30 * time.Second):
		t.Fatal("the refused member's channel is still open")
	}
	require.True(t, logs.has("Consumer group refused this member"))
	require.Contains(t, logs.errorText(), "group.min.session.timeout.ms is 5000")
}

// drain discards messages until ch closes, then reports it closed.
func drain[T any](ch <-chan T) <-chan T {
	out := make(chan T)
	go func() {
		for range ch {
		}
		close(out)
	}()
	return out
}

var _ = uuid.NewString
