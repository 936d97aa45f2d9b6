package main

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
)

// TestQuickstart runs the README's usage: one payment delivered three times
// makes one ledger row and one email.
func TestQuickstart(t *testing.T) {
	t.Parallel()
	pgtest.Require(t)
	schema := pgtest.NewSchemaName()
	t.Cleanup(func() { pgtest.DropSchema(t, schema) })
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	require.NoError(t, run(ctx, pgtest.URL(), schema))

	db := pgtest.NewPool(t, schema, 2)
	require.Equal(t, 1, pgtest.Count(t, db, `SELECT count(*) FROM `+schema+`.ledger`))
	require.Equal(t, 1, pgtest.Count(t, db, `SELECT count(*) FROM `+schema+`.inbox WHERE state = 'completed'`))
	require.Equal(t, 2, pgtest.Count(t, db, `SELECT count(*) FROM `+schema+`.effects WHERE state = 'done'`),
		"the receipt email and the receipts message")
}
