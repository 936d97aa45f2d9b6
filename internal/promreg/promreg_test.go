package promreg_test

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/promreg"
)

func TestRegisterSharesAndReports(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	newCounter := func() *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Name: "x_total", Help: "x"}, []string{"l"})
	}
	var err error
	first := promreg.Register(reg, newCounter(), &err)
	second := promreg.Register(reg, newCounter(), &err)
	require.NoError(t, err)
	require.Same(t, first, second, "the second registration shares the first collector")

	// Same name, other labels: a real conflict, reported.
	clash := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "x_total", Help: "x"}, []string{"other"})
	got := promreg.Register(reg, clash, &err)
	require.Error(t, err)
	require.Same(t, clash, got)

	// No registry: nothing registered, no error.
	var none error
	c := newCounter()
	require.Same(t, c, promreg.Register(nil, c, &none))
	require.NoError(t, none)
}

func TestShardLabelsEverySeriesAndShares(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	newCounter := func() *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Name: "x_total", Help: "x"}, []string{"l"})
	}
	var err error
	s1 := promreg.Register(promreg.Shard(reg, "s1"), newCounter(), &err)
	s1again := promreg.Register(promreg.Shard(reg, "s1"), newCounter(), &err)
	s2 := promreg.Register(promreg.Shard(reg, "s2"), newCounter(), &err)
	require.NoError(t, err)
	require.Same(t, s1, s1again, "one shard's parts share its collector")
	require.NotSame(t, s1, s2, "each shard has its own")
	s1.WithLabelValues("a").Add(2)
	s2.WithLabelValues("a").Add(3)
	mfs, err := reg.Gather()
	require.NoError(t, err)
	require.Len(t, mfs, 1)
	got := map[string]float64{}
	for _, m := range mfs[0].GetMetric() {
		labels := map[string]string{}
		for _, l := range m.GetLabel() {
			labels[l.GetName()] = l.GetValue()
		}
		require.Equal(t, "a", labels["l"])
		got[labels[promreg.ShardLabel]] = m.GetCounter().GetValue()
	}
	require.Equal(t, map[string]float64{"s1": 2, "s2": 3}, got)

	// A single-database collector of the same family on the same registry has
	// other label names: Prometheus refuses it, and the error is reported.
	promreg.Register(reg, newCounter(), &err)
	require.Error(t, err)

	require.Nil(t, promreg.Shard(nil, "s1"))
}

func TestFactorySharesAndReports(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	a, b := promreg.With(reg), promreg.With(reg)
	first := a.Counter("f_total", "f", "l")
	require.Same(t, first, b.Counter("f_total", "f", "l"), "a second factory on the registry shares the collector")
	require.NoError(t, a.Err())
	require.NoError(t, b.Err())

	// A clash is gathered, not panicked, and every clash is reported.
	b.Gauge("f_total", "f", "other")
	b.Histogram("f_total", "f", prometheus.DefBuckets, "third")
	require.Error(t, b.Err())
	require.Len(t, b.Err().(interface{ Unwrap() []error }).Unwrap(), 2)

	// The histogram gets its buckets.
	h := a.Histogram("h_seconds", "h", []float64{1, 2})
	h.WithLabelValues().Observe(1.5)
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == "h_seconds" {
			require.Len(t, mf.GetMetric()[0].GetHistogram().GetBucket(), 2)
		}
	}

	// No registry: collectors made, nothing registered, no error.
	none := promreg.With(nil)
	require.NotNil(t, none.Counter("f_total", "f", "l"))
	require.NoError(t, none.Err())
}

func TestZeroMakesSeries(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	f := promreg.With(reg)
	c := f.Counter("z_total", "z", "l")
	h := f.Histogram("z_seconds", "z", []float64{1}, "l")
	promreg.Zero([]string{"a"}, c.MetricVec, h.MetricVec)
	mfs, err := reg.Gather()
	require.NoError(t, err)
	require.Len(t, mfs, 2, "both families have a series before any event")
	require.Panics(t, func() { promreg.Zero([]string{"a", "b"}, c.MetricVec) })
}
