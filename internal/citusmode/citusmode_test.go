package citusmode_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/citusmode"
	"github.com/idemkit/idem/internal/pgtest"
)

// counting is a Querier that counts the queries it passes on.
type counting struct {
	q citusmode.Querier
	n atomic.Int64
}

func (c *counting) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	c.n.Add(1)
	return c.q.QueryRow(ctx, sql, args...)
}

// A schema migrated in Citus mode is distributed; one migrated plainly on the
// coordinator, and any on plain Postgres, are not (one query there). A Detector
// asks once.
func TestDistributed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	citus, schema := pgtest.CitusSetup(t, pgtest.Options{MaxConns: 2})
	plainOnCitus, plainSchema := pgtest.Citus(t, pgtest.Options{MaxConns: 2})
	_, err := plainOnCitus.Exec(ctx, `CREATE TABLE inbox (tenant text)`)
	require.NoError(t, err)
	plain, plainPG := pgtest.Setup(t, pgtest.Options{MaxConns: 2})

	var d citusmode.Detector
	q := &counting{q: citus}
	for range 2 {
		on, err := d.On(ctx, q, pgx.Identifier{schema, "inbox"}.Sanitize())
		require.NoError(t, err)
		require.True(t, on)
	}
	require.EqualValues(t, 2, q.n.Load(), "asked once: is Citus installed, is the table distributed")
	on, known := d.Known()
	require.True(t, on && known)

	on, err = citusmode.Distributed(ctx, plainOnCitus, pgx.Identifier{plainSchema, "inbox"}.Sanitize())
	require.NoError(t, err)
	require.False(t, on)
	pq := &counting{q: plain}
	on, err = citusmode.Distributed(ctx, pq, pgx.Identifier{plainPG, "inbox"}.Sanitize())
	require.NoError(t, err)
	require.False(t, on)
	require.EqualValues(t, 1, pq.n.Load(), "one query on plain Postgres")
}

// A Detector keeps no error: a question that fails is asked again by the next
// call. Callers at once ask one question between them, and read the answer kept.
func TestDetectorAsksOnceAndKeepsNoError(t *testing.T) {
	t.Parallel()
	plain, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 2})
	table := pgx.Identifier{schema, "inbox"}.Sanitize()
	var d citusmode.Detector
	q := &counting{q: plain}
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := d.On(cancelled, q, table)
	require.Error(t, err)
	_, known := d.Known()
	require.False(t, known, "an error is not an answer")

	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			on, err := d.On(context.Background(), q, table)
			require.NoError(t, err)
			require.False(t, on)
		})
	}
	wg.Wait()
	require.EqualValues(t, 2, q.n.Load(), "the failed question, then one for the eight callers")
	on, known := d.Known()
	require.True(t, known)
	require.False(t, on)
}
