package httpidem

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/tracing"
)

// TestNoTracingAllocatesNothing: with the default (no-op) provider, a request's
// claim, handler and commit spans cost no allocation.
func TestNoTracingAllocatesNothing(t *testing.T) {
	e := &engine{tracer: tracing.Tracer(nil)}
	ctx := context.Background()
	allocs := testing.AllocsPerRun(100, func() {
		for _, name := range []string{spanClaim, spanHandler, spanCommit} {
			_, span := e.child(ctx, name)
			endSpan(span, nil)
		}
	})
	require.Zero(t, allocs)
}
