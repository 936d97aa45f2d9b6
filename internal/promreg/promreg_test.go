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
