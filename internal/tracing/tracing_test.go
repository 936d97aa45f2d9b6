package tracing_test

import (
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/idemkit/idem/internal/tracing"
)

// provider is a tracer provider of the application's: not the API's no-op.
type provider struct{ noop.TracerProvider }

// TestOff: tracing is off with the API's no-op provider and with the default
// global one, and on with any other, including the global provider once the
// application installs one. (Not parallel: it installs a global provider.)
func TestOff(t *testing.T) {
	require.True(t, tracing.Off(nil), "nothing installed")
	require.True(t, tracing.Off(otel.GetTracerProvider()), "the default global provider, passed explicitly")
	require.True(t, tracing.Off(noop.NewTracerProvider()))
	require.False(t, tracing.Off(provider{}))
	require.Zero(t, testing.AllocsPerRun(100, func() { tracing.Off(nil) }))

	global := otel.GetTracerProvider()
	otel.SetTracerProvider(provider{})
	require.False(t, tracing.Off(nil), "the application installed a provider")
	require.False(t, tracing.Off(global), "the default global provider delegates to it now")
}
