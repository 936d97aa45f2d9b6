package effects

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/tracing"
)

// TestNoopSendSpanAllocatesNothing: with no tracer provider installed, an
// attempt's span costs no allocation.
func TestNoopSendSpanAllocatesNothing(t *testing.T) {
	d := &dispatcher{tracer: tracing.Tracer(nil)}
	c := &claimed{batch: &claimBatch{ctx: context.Background()}}
	require.Zero(t, testing.AllocsPerRun(1000, func() {
		_, span := d.startSend(c)
		endSend(span, outcome{label: "done"})
	}))
}
