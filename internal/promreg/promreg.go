// Package promreg registers idem's Prometheus collectors on the Registerer a user
// passes in, the one way every idem package does it. It imports nothing of idem.
package promreg

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// Register registers c on reg and returns it, or returns the collector already
// registered on reg under the same description, so that several consumers,
// dispatchers, middlewares or janitors on one registry share their metrics. A nil
// reg registers nothing and returns c. Any other failure is joined to *errp and c
// is returned, so that a constructor registers all of its collectors and reports
// every failure at once.
func Register[C prometheus.Collector](reg prometheus.Registerer, c C, errp *error) C {
	if reg == nil {
		return c
	}
	if err := reg.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if existing, ok := are.ExistingCollector.(C); ok {
				return existing
			}
		}
		*errp = errors.Join(*errp, err)
	}
	return c
}

// Factory makes collectors and registers each on one Registerer as it makes it,
// as Register does, from a name, a help text and label names. It is like promauto.With, but it shares a collector already registered
// and gathers failures instead of panicking: Err reports them.
type Factory struct {
	reg prometheus.Registerer
	err error
}

// With returns a Factory that registers on reg (nil: registers nothing).
func With(reg prometheus.Registerer) *Factory { return &Factory{reg: reg} }

// Counter makes and registers a counter vector.
func (f *Factory) Counter(name, help string, labels ...string) *prometheus.CounterVec {
	return Register(f.reg, prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, labels), &f.err)
}

// Gauge makes and registers a gauge vector.
func (f *Factory) Gauge(name, help string, labels ...string) *prometheus.GaugeVec {
	return Register(f.reg, prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: name, Help: help}, labels), &f.err)
}

// Histogram makes and registers a histogram vector with the given buckets.
func (f *Factory) Histogram(name, help string, buckets []float64, labels ...string) *prometheus.HistogramVec {
	opts := prometheus.HistogramOpts{Name: name, Help: help, Buckets: buckets}
	return Register(f.reg, prometheus.NewHistogramVec(opts, labels), &f.err)
}

// Err returns every registration failure so far, joined (nil if none).
func (f *Factory) Err() error { return f.err }

// Zero makes the series with the label values lvs of every vec exist, at zero, so
// that a dashboard's rate() and an alert on increase() see them from the start,
// not from the first event. Like WithLabelValues, it panics on a wrong number of
// label values.
func Zero(lvs []string, vecs ...*prometheus.MetricVec) {
	for _, v := range vecs {
		if _, err := v.GetMetricWithLabelValues(lvs...); err != nil {
			panic(err)
		}
	}
}

// ShardLabel is the label every series of a shard map's per-shard part carries:
// the shard's name.
const ShardLabel = "shard"

// Shard returns reg with the constant label shard=name on every series registered
// through it, the Registerer of a shard map's per-shard part (nil for a nil reg).
// The label is in the collectors' descriptions, so recording a sample costs nothing
// more. Prometheus refuses two registrations of a family with different label
// names on one registry, so a family's series on one registry are either all
// per-shard or all single-database.
func Shard(reg prometheus.Registerer, name string) prometheus.Registerer {
	if reg == nil {
		return nil
	}
	return prometheus.WrapRegistererWith(prometheus.Labels{ShardLabel: name}, reg)
}
