package citusmode_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/citusmode"
	"github.com/idemkit/idem/internal/pgtest"
)

// counting is a Querier that counts the queries it passes on.
type counting struct {
	q citusmode.Querier
	n int
}

func (c *counting) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	c.n++
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
	require.Equal(t, 2, q.n, "asked once: is Citus installed, is the table distributed")
	on, known := d.Known()
	require.True(t, on && known)

	on, err = citusmode.Distributed(ctx, plainOnCitus, pgx.Identifier{plainSchema, "inbox"}.Sanitize())
	require.NoError(t, err)
	require.False(t, on)
	pq := &counting{q: plain}
	on, err = citusmode.Distributed(ctx, pq, pgx.Identifier{plainPG, "inbox"}.Sanitize())
	require.NoError(t, err)
	require.False(t, on)
	require.Equal(t, 1, pq.n, "one query on plain Postgres")
}
