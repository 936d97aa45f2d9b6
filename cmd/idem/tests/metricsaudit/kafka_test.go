package metricsaudit

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/idemkit/idem/adapters/kafka"
)

// kafkaPrefix starts the families of the Kafka adapter's Subscriber.
const kafkaPrefix = "idem_kafka_"

// The Kafka Subscriber's families are the ones docs/observability.md's Metrics
// table names with its prefix. Their series are per partition, so they come
// with a Subscribe: MetricPartitionHeld at 0 for each partition read, before
// any record; MetricPartitionHeldOffset, registered, has no series until a
// record holds a partition.
func TestKafkaSubscriberMetricsAreDocumented(t *testing.T) {
	t.Parallel()
	var documented []string
	for _, name := range readmeMetricNames(t) {
		if strings.HasPrefix(name, kafkaPrefix) {
			documented = append(documented, name)
		}
	}
	require.ElementsMatch(t, []string{kafka.MetricPartitionHeld, kafka.MetricPartitionHeldOffset}, documented,
		"docs/observability.md's Metrics table names every family of the Kafka Subscriber, and no other idem_kafka_ one")

	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(2, "orders"))
	require.NoError(t, err)
	t.Cleanup(c.Close)
	reg := prometheus.NewRegistry()
	cfg := kafka.SubscriberConfig{Registerer: reg}
	cfg.Brokers = c.ListenAddrs()
	sub, err := kafka.NewSubscriber(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	_, err = sub.Subscribe(ctx, "orders")
	require.NoError(t, err)

	var partitions []string
	require.Eventually(t, func() bool {
		mfs, err := reg.Gather()
		require.NoError(t, err)
		partitions = nil
		for _, mf := range mfs {
			require.Equal(t, kafka.MetricPartitionHeld, mf.GetName(), "only the held gauge has series before a record is held")
			for _, m := range mf.GetMetric() {
				requireZero(t, mf.GetName(), mf.GetType(), m)
				labels := map[string]string{}
				for _, l := range m.GetLabel() {
					labels[l.GetName()] = l.GetValue()
				}
				require.Equal(t, map[string]string{"group": "", "topic": "orders", "partition": labels["partition"]}, labels)
				partitions = append(partitions, labels["partition"])
			}
		}
		return len(partitions) == 2
	}, 10*time.Second, 10*time.Millisecond)
	slices.Sort(partitions)
	require.Equal(t, []string{"0", "1"}, partitions)

	// The held offset's family is registered, without series: registering it
	// again is refused.
	for _, name := range documented {
		err := reg.Register(prometheus.NewGauge(prometheus.GaugeOpts{Name: name, Help: "audit " + strconv.Itoa(len(name))}))
		require.Error(t, err, "%s is not registered by the Subscriber", name)
	}
}
