package pgtest

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The proxy adds its round trip to every statement and keeps the connection
// usable; an outage cuts the pool's connections and refuses new ones until it
// ends, and the pool works again afterwards.
func TestProxy(t *testing.T) {
	t.Parallel()
	_, schema := Setup(t)
	ctx := context.Background()
	var one int

	slow := NewProxy(t, 20*time.Millisecond).Pool(t, schema, Options{MaxConns: 1})
	require.NoError(t, slow.QueryRow(ctx, `SELECT 1`).Scan(&one)) // connect
	start := time.Now()
	require.NoError(t, slow.QueryRow(ctx, `SELECT 1`).Scan(&one))
	took := time.Since(start)
	require.GreaterOrEqual(t, took, 20*time.Millisecond)
	require.Less(t, took, 2*time.Second)

	p := NewProxy(t, 0)
	pool := p.Pool(t, schema, Options{MaxConns: 2})
	require.NoError(t, pool.QueryRow(ctx, `SELECT 1`).Scan(&one))
	p.Outage(500 * time.Millisecond)
	cctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	require.Error(t, pool.QueryRow(cctx, `SELECT 1`).Scan(&one), "down: the pooled connection is cut, a new one refused")
	WaitFor(t, 30*time.Second, "a query through the proxy after the outage", func() bool { return pool.QueryRow(ctx, `SELECT 1`).Scan(&one) == nil })
	require.Positive(t, p.Refused())
}
