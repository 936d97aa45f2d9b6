package kafka_test

import (
	"errors"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/idemkit/idem/internal/pgtest"
)

// A broker outage mid-stream loses nothing: for a few seconds kfake closes the
// connection of every request a client sends (fetches, heartbeats, offset commits,
// metadata, joins), the way a broker restart or a network cut looks to a client.
// The Subscriber retries, its group joins again, every message is delivered (some
// twice, which the inbox is there for), and the group's committed offsets reach
// the end of every partition once the broker is back. Run with one record in
// flight per partition and with several.
func TestBrokerOutageLosesNothing(t *testing.T) {
	t.Parallel()
	for _, inFlight := range []int{1, 8} {
		t.Run("in-flight="+strconv.Itoa(inFlight), func(t *testing.T) {
			t.Parallel()
			const partitions = 3
			cluster, err := kfake.NewCluster(kfake.NumBrokers(1),
				kfake.BrokerConfigs(map[string]string{"group.min.session.timeout.ms": "100"}))
			require.NoError(t, err)
			t.Cleanup(cluster.Close)
			b := setup(t, cluster.ListenAddrs(), partitions)
			c := newCollector()
			cfg := subscriberConfig(b.brokers, b.group, partitions)
			cfg.MaxInFlightPerPartition = inFlight
			_, ch := b.subscribe(t, cfg)
			go c.consume(ch, time.Millisecond)
			sent := b.publish(t, 150)
			pgtest.WaitFor(t, receiveTimeout, "all but 100 messages received", func() bool { return len(c.missing(sent)) <= 100 })

			// The outage: every request's connection is closed, until it ends.
			var down atomic.Bool
			var refused atomic.Int64
			down.Store(true)
			cluster.Control(func(kmsg.Request) (kmsg.Response, error, bool) {
				if !down.Load() {
					cluster.DropControl()
					return nil, nil, false
				}
				cluster.KeepControl()
				refused.Add(1)
				return nil, errors.New("broker outage"), true
			})
			time.Sleep(3 * time.Second)
			down.Store(false)
			require.Positive(t, refused.Load(), "the outage refused the client's requests")

			sent = append(sent, b.publish(t, 150)...)
			waitAll(t, c, sent)
			ends := partitionEnds(t, b, partitions)
			for p := range partitions {
				requireCommittedAt(t, b, p, ends[p])
			}
			t.Logf("%d messages, %d duplicates, %d requests refused during the outage", len(sent), c.duplicates(), refused.Load())
		})
	}
}
