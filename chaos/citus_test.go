package chaos_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/chaos"
	"github.com/idemkit/idem/internal/pgtest"
)

// On Citus a report of one tenant is one snapshot of that tenant's rows. Citus
// begins the report's REPEATABLE READ transaction on each worker when the report
// first reaches it, so there is no snapshot across workers, and a read of many
// shards may open more connections to a worker, each with a snapshot of its own
// (citus.force_max_query_parallelization makes it open one a shard). But a
// transaction reads the shards it has read before, and the shards colocated with
// them, over the same connection. The inbox read names the tenant, so it fixes
// the snapshot of the tenant's shards, and the ledger and effects reads that
// follow, which read every shard, see the tenant's rows in it: a consumer's
// transaction of the tenant that commits between the reads is in none of the
// report's figures. The transaction of a tenant on the other worker, committed at
// the same moment, is in the ledger read, whose snapshot of that worker begins
// there: its keys are unexpected keys, as any other tenant's are.
func TestCitusReportIsOneSnapshotOfItsTenant(t *testing.T) {
	pool, schema := pgtest.CitusSetup(t, pgtest.Options{MaxConns: 4,
		Settings: map[string]string{"citus.force_max_query_parallelization": "on"}})
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE ledger (tenant text NOT NULL, key text NOT NULL, payload text NOT NULL)`)
	require.NoError(t, err)
	pgtest.Distribute(t, pool, schema, "ledger")
	ledger := pgx.Identifier{schema, "ledger"}.Sanitize()
	// The audited tenant, and one on the other worker.
	tenant, other := "t0", ""
	for i := 1; other == ""; i++ {
		if c := fmt.Sprint("t", i); pgtest.CitusWorkerOf(t, pool, ledger, c) != pgtest.CitusWorkerOf(t, pool, ledger, tenant) {
			other = c
		}
	}

	keys, otherKeys := paymentKeys(20), make([]string, 20)
	for i := range otherKeys {
		otherKeys[i] = "other-" + keys[i]
	}
	mine := writeTenantPayments(ctx, t, pool, tenant, keys)
	theirs := writeTenantPayments(ctx, t, pool, other, otherKeys)

	a, err := chaos.NewAuditor(chaos.AuditorConfig{Pool: pool, Schema: schema})
	require.NoError(t, err)
	commits := 0
	chaos.SetBetweenReads(a, func() {
		if commits++; commits == 1 {
			require.NoError(t, mine.Commit(ctx))
			require.NoError(t, theirs.Commit(ctx))
		}
	})
	q := auditQuery(idemTransactional, keys, -1, -1)
	q.Tenant = tenant
	rep, err := a.Report(ctx, q)
	require.NoError(t, err)
	t.Logf("\n%s", rep)
	require.Equal(t, 1, commits, "the consumers committed between the report's reads")
	require.Equal(t, [3]int{0, 0, 0}, [3]int{rep.InboxCompleted, rep.InboxFailed, rep.InboxProcessing})
	require.Equal(t, [3]int{0, 0, 20}, [3]int{rep.CommittedOnce, rep.CommittedTwice, rep.Lost})
	require.Equal(t, [2]int{0, 20}, [2]int{rep.EffectsDone, rep.EffectsMissing})
	require.Zero(t, rep.Inconsistent)
	require.Equal(t, 20, rep.Unexpected, "the other worker's tenant's keys, read in that worker's snapshot")

	rep, err = a.Report(ctx, q)
	require.NoError(t, err)
	require.Equal(t, [3]int{20, 0, 0}, [3]int{rep.InboxCompleted, rep.InboxFailed, rep.InboxProcessing})
	require.Equal(t, [4]int{20, 0, 0, 20}, [4]int{rep.CommittedOnce, rep.Lost, rep.EffectsMissing, rep.EffectsDone})
	require.Zero(t, rep.Inconsistent)
}

// writeTenantPayments begins a transaction that writes the rows an idem consumer
// commits for each key of tenant: the completed inbox row, the ledger row and the
// email effect, done. The caller commits it.
func writeTenantPayments(ctx context.Context, t *testing.T, pool *pgxpool.Pool, tenant string, keys []string) pgx.Tx {
	t.Helper()
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(ctx) })
	for _, sql := range []string{
		`INSERT INTO inbox (consumer, tenant, key, fingerprint, state, expires_at)
			SELECT 'payments', $2, k, '\x00', 'completed', now() + interval '1 day' FROM unnest($1::text[]) AS k`,
		`INSERT INTO ledger (tenant, key, payload) SELECT $2, k, '' FROM unnest($1::text[]) AS k`,
		`INSERT INTO effects (tenant, kind, key, fingerprint, state, source_consumer, source_tenant, source_key)
			SELECT $2, 'email', 'receipt:' || k, '\x00', 'done', 'payments', $2, k FROM unnest($1::text[]) AS k`,
	} {
		_, err := tx.Exec(ctx, sql, keys, tenant)
		require.NoError(t, err)
	}
	return tx
}
