package admin

import (
	"context"
	"maps"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
)

// The failure metrics' descriptions. No label names a failure group: groups are
// unbounded in number, and a series per group would be too.
var (
	failedKeysDesc = prometheus.NewDesc("idem_inbox_failed_keys",
		"Inbox keys recorded as failed (permanent failures that a release would run again), by consumer.",
		[]string{"consumer"}, nil)
	deadEffectsDesc = prometheus.NewDesc("idem_effects_dead_rows",
		"Dead effects (retry or discard them by failure group), by kind.",
		[]string{"kind"}, nil)
	repairedDesc = prometheus.NewDesc("idem_failures_repaired_total",
		"Failed inbox keys and dead effects changed by repair actions on failure groups, by action (retry, discard, release), from the stored audit of the actions.",
		[]string{"action"}, nil)
)

// failureMetrics is the Prometheus collector of Config.Registerer, one for the
// database or one a shard (its series labelled with the shard's name): it reads
// the counts from the tables when scraped, at most once per interval, so every
// process that registers it reports the same numbers, whoever failed or repaired
// the rows.
type failureMetrics struct {
	a *part

	mu      sync.Mutex
	readAt  time.Time
	inbox   map[string]float64
	effects map[string]float64
	actions map[string]float64
}

func newFailureMetrics(a *part) *failureMetrics {
	m := &failureMetrics{a: a, inbox: map[string]float64{}, effects: map[string]float64{}, actions: map[string]float64{}}
	for _, c := range a.cfg.Consumers {
		m.inbox[c] = 0
	}
	for _, k := range a.cfg.Kinds {
		m.effects[k] = 0
	}
	for _, act := range actions {
		m.actions[act] = 0
	}
	return m
}

// Describe sends the three descriptions.
func (m *failureMetrics) Describe(ch chan<- *prometheus.Desc) {
	ch <- failedKeysDesc
	ch <- deadEffectsDesc
	ch <- repairedDesc
}

// Collect reads the tables if the last reading is older than the interval, and
// sends every series: the configured consumers, kinds and every action at 0 when
// there is nothing to count. A failed read keeps the last values (and logs).
func (m *failureMetrics) Collect(ch chan<- prometheus.Metric) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if time.Since(m.readAt) >= m.a.cfg.MetricsInterval {
		if err := m.read(); err != nil {
			m.a.cfg.Logger.Warn("idem: reading the failure metrics failed; reporting the last values", "error", err)
		} else {
			m.readAt = time.Now()
		}
	}
	for c, v := range m.inbox {
		ch <- prometheus.MustNewConstMetric(failedKeysDesc, prometheus.GaugeValue, v, c)
	}
	for k, v := range m.effects {
		ch <- prometheus.MustNewConstMetric(deadEffectsDesc, prometheus.GaugeValue, v, k)
	}
	for act, v := range m.actions {
		ch <- prometheus.MustNewConstMetric(repairedDesc, prometheus.CounterValue, v, act)
	}
}

func (m *failureMetrics) read() error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	a := m.a
	inbox, effects, actions := map[string]float64{}, map[string]float64{}, map[string]float64{}
	rows, err := a.db.Query(ctx, a.q.failureMetrics)
	if err != nil {
		return a.wrap(err)
	}
	var what, name string
	var n float64
	_, err = pgx.ForEachRow(rows, []any{&what, &name, &n}, func() error {
		switch what {
		case SourceInbox:
			inbox[name] += n
		case SourceEffects:
			effects[name] += n
		default:
			actions[name] += n
		}
		return nil
	})
	if err != nil {
		return a.wrap(err)
	}
	// A consumer or kind seen once stays, at 0 when it has nothing left.
	for c := range m.inbox {
		m.inbox[c] = inbox[c]
	}
	for k := range m.effects {
		m.effects[k] = effects[k]
	}
	maps.Copy(m.inbox, inbox)
	maps.Copy(m.effects, effects)
	maps.Copy(m.actions, actions)
	return nil
}
