package kafka

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem/internal/promreg"
)

// metrics are a Subscriber's collectors. Their labels are bounded: the group,
// the topics subscribed, their partitions, and the codes of the handler side.
type metrics struct {
	held       *prometheus.GaugeVec // group, topic, partition
	heldOffset *prometheus.GaugeVec // group, topic, partition, code
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	f := promreg.With(reg)
	m := &metrics{
		held: f.Gauge(MetricPartitionHeld,
			"1 while a record nacked with a permanent error holds the partition (nothing past it is committed until it is acked), else 0",
			"group", "topic", "partition"),
		heldOffset: f.Gauge(MetricPartitionHeldOffset,
			"The offset of the record nacked with a permanent error that holds the partition, with its error code; no series while none does",
			"group", "topic", "partition", "code"),
	}
	return m, f.Err()
}

// heldGauge shows whether one partition of one Subscribe call is held, and by
// which record. It belongs to the partition's run goroutine.
type heldGauge struct {
	m      *metrics
	labels []string // group, topic, partition

	shown  bool
	offset int64
	code   string
}

func (m *metrics) partition(group, topic string, partition int) *heldGauge {
	g := &heldGauge{m: m, labels: []string{group, topic, strconv.Itoa(partition)}}
	g.m.held.WithLabelValues(g.labels...).Set(0)
	return g
}

// show reports the record at offset, nacked with code, as the one holding the
// partition; held false reports none.
func (g *heldGauge) show(held bool, offset int64, code string) {
	if held == g.shown && (!held || offset == g.offset && code == g.code) {
		return
	}
	if g.shown {
		g.m.heldOffset.DeleteLabelValues(append(g.labels[:3:3], g.code)...)
	}
	g.shown, g.offset, g.code = held, offset, code
	if !held {
		g.m.held.WithLabelValues(g.labels...).Set(0)
		return
	}
	g.m.heldOffset.WithLabelValues(append(g.labels[:3:3], code)...).Set(float64(offset))
	g.m.held.WithLabelValues(g.labels...).Set(1)
}
