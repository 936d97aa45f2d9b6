package kafka

import (
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The pause doubles per nack in a row up to the cap, and never overflows,
// however many nacks and however large the cap.
func TestNackPause(t *testing.T) {
	ms := time.Millisecond
	for _, c := range []struct {
		base, limit time.Duration
		n           int
		want        time.Duration
	}{
		{100 * ms, 10 * time.Second, 1, 100 * ms},
		{100 * ms, 10 * time.Second, 2, 200 * ms},
		{100 * ms, 10 * time.Second, 7, 6400 * ms},
		{100 * ms, 10 * time.Second, 8, 10 * time.Second},
		{100 * ms, 10 * time.Second, 1 << 30, 10 * time.Second},
		{time.Second, time.Second, 5, time.Second},
		{time.Hour, math.MaxInt64, 1000, math.MaxInt64},
	} {
		require.Equal(t, c.want, nackPause(c.base, c.limit, c.n), "%+v", c)
	}
}
