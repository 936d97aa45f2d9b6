package sqlaudit_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/sqlaudit"
	"github.com/idemkit/idem/internal/txmark"
)

// TestRoutable: what names one tenant, and what does not.
func TestRoutable(t *testing.T) {
	t.Parallel()
	for _, sql := range []string{
		`SELECT * FROM inbox WHERE consumer = $1 AND tenant = $2 AND key = $3`,
		"DELETE FROM inbox i USING unnest($1::text[]) AS u(key)\n\t\tWHERE i.tenant = $4 AND i.key = u.key",
		`SELECT * FROM unnest($1::text[]) u JOIN effects e ON e.tenant = $2 AND e.key = u.key`,
		`INSERT INTO "s"."effects" (tenant, kind, key) VALUES ($1, $2, $3)`,
		`INSERT INTO inbox (consumer, tenant, key) VALUES ($1, $2::text, $3) ON CONFLICT DO NOTHING`,
		`INSERT INTO inbox (consumer, tenant, key) SELECT $1::text, $2::text, $3::text FROM (SELECT 1) s`,
		`INSERT INTO inbox AS i (consumer, tenant, key) VALUES ($1, $2, now() + $3::interval)`,
	} {
		require.True(t, sqlaudit.Routable(sql), sql)
	}
	for _, sql := range []string{
		`SELECT * FROM inbox WHERE consumer = $1 AND key = $3`,
		`SELECT * FROM inbox WHERE tenant = ANY($1)`,
		`SELECT * FROM effects WHERE source_tenant = $1`,
		`UPDATE effects SET state = 'pending' WHERE (($4 = '' AND NOT $5) OR tenant = $4)`,
		`UPDATE effects SET state = 'pending' WHERE kind = $1 OR tenant = $4`,
		`UPDATE effects e SET state = d.state FROM unnest($1::text[]) d(tenant) WHERE e.tenant = d.tenant`,
		`INSERT INTO inbox (consumer, tenant, key) SELECT consumer, tenant, key FROM unnest($1, $2, $3) u(consumer, tenant, key)`,
		`INSERT INTO inbox (tenant) VALUES (lower($1))`,
		`INSERT INTO commit_guard DEFAULT VALUES`,
		`SELECT pg_notify('idem_effects', $1)`,
	} {
		require.False(t, sqlaudit.Routable(sql), sql)
	}
	for _, sql := range []string{"BEGIN", "begin isolation level read committed", "COMMIT", "rollback",
		"SAVEPOINT idem_0", "release savepoint idem_1", "ROLLBACK TO SAVEPOINT idem_batch",
		"SET LOCAL lock_timeout = 2000", "SET LOCAL idem.tx = 'on'", "SET TRANSACTION READ ONLY"} {
		require.True(t, sqlaudit.Control(sql), sql)
	}
	for _, sql := range []string{"SELECT 1", "SET search_path = x", "COMMIT; SELECT 1", "LISTEN idem_effects"} {
		require.False(t, sqlaudit.Control(sql), sql)
	}
}

// TestInboxStatementsNameOneTenant is the static audit of the inbox table's
// statements (every string field of inboxdb.Queries, including ones added later).
func TestInboxStatementsNameOneTenant(t *testing.T) {
	t.Parallel()
	require.Empty(t, sqlaudit.CheckFields(inboxdb.New("idem"), map[string]string{
		"DeleteExpired":      "the janitor's retention delete, across tenants",
		"DeleteExpiredByKey": "the janitor's retention delete on Citus, across tenants",
		"ClaimBatch":         "a batch of several tenants (ClaimBatchOneTenant names one)",
		"GetBatch":           "a batch of several tenants (GetBatchOneTenant names one)",
		"DeleteExpiredKeys":  "a batch of several tenants (DeleteExpiredKeysOneTenant names one)",
	}))
	// It catches a statement that names no tenant.
	q := inboxdb.New("idem")
	q.Get = `SELECT * FROM inbox WHERE consumer = $1 AND key = $3`
	require.Len(t, sqlaudit.CheckFields(q, map[string]string{"DeleteExpired": "", "DeleteExpiredByKey": "", "ClaimBatch": "", "GetBatch": "", "DeleteExpiredKeys": ""}), 1)
}

// CitusRefusals knows each refusal idem's statements met on Citus 13.2, in the
// forms idem sent before it was rewritten, and takes the rewrites.
func TestCitusRefusals(t *testing.T) {
	t.Parallel()
	q := inboxdb.New("idem")
	oldMarked := "coalesce(current_setting('idem.tx', true), '') = 'on'"
	for sql, want := range map[string]string{
		// enqueue's wake-up
		`WITH ins AS (INSERT INTO e (tenant, k) VALUES ($1, $2) RETURNING true AS ok),
			wake AS (SELECT pg_notify('idem_effects', 's') FROM (SELECT FROM ins LIMIT 1) one)
			SELECT ok FROM ins WHERE (SELECT true FROM wake) IS NOT FALSE`: `column "pg_notify" has pseudo-type void`,
		// the lease's takeover
		strings.Replace(q.Lease, "EXCLUDED.received_at", "now()", 1): "functions used in the WHERE clause of the ON CONFLICT clause of INSERTs on distributed tables must be marked IMMUTABLE",
		// the stored response's guarded write
		strings.Replace(q.SaveResponseOrFail, txmark.Marked, oldMarked, 1): "non-IMMUTABLE functions are not allowed in CASE or COALESCE statements",
		// an outcome write
		`UPDATE e SET done_at = CASE WHEN d.state = 'done' THEN now() END FROM unnest($1::text[]) AS d(state) WHERE e.tenant = $2`: "non-IMMUTABLE functions are not allowed in CASE or COALESCE statements",
		// a claim's lag
		`UPDATE e SET fence = fence + 1 WHERE tenant = $1 RETURNING extract(epoch FROM now() - e.due)`: "non-IMMUTABLE functions are not allowed in the RETURNING clause",
		// the janitor's plain delete
		q.DeleteExpired: "could not run distributed query with FOR UPDATE/SHARE commands",
		// the claim's plan setting
		"SET LOCAL plan_cache_mode = force_generic_plan": "could not create distributed plan: generic plans of parameterized statements",
		// a loose index scan of every tenant (admin's Find on plain Postgres)
		`WITH RECURSIVE pairs AS ((SELECT a, tenant FROM e ORDER BY 1, 2 LIMIT 1) UNION ALL SELECT n.a, n.tenant FROM pairs p CROSS JOIN LATERAL (SELECT a, tenant FROM e WHERE (a, tenant) > (p.a, p.tenant) ORDER BY 1, 2 LIMIT 1) n)
			SELECT * FROM pairs JOIN e ON e.a = pairs.a AND e.tenant = pairs.tenant WHERE ($1::text IS NULL OR pairs.tenant = $1)`: "recursive CTEs are only supported when they contain a filter on the distribution column",
		// now() in a DELETE's RETURNING (admin's Forget read it there)
		`DELETE FROM i WHERE tenant = $1 AND key = $2 RETURNING i.key, now()`: "non-IMMUTABLE functions are not allowed in the RETURNING clause",
	} {
		require.Equal(t, []string{want}, sqlaudit.CitusRefusals(sql), sql)
	}
	for _, sql := range []string{
		q.Lease, q.SaveResponseOrFail, q.CompleteLeaseResponseOrFail, q.DeleteExpiredByKey, q.Claim, q.Fail,
		// pg_notify of its own, and cast in a CTE
		`SELECT pg_notify('idem_effects', $1)`,
		`WITH ins AS (INSERT INTO e (tenant) VALUES ($1) RETURNING 1), wake AS (SELECT pg_notify('c', 's')::text FROM ins) SELECT 1`,
		// a row lock of one tenant's rows
		`SELECT * FROM e WHERE tenant = $1 FOR UPDATE SKIP LOCKED`,
		// a recursive CTE of one tenant's rows
		`WITH RECURSIVE r AS (SELECT 1 AS n UNION ALL SELECT n + 1 FROM r WHERE n < 3) SELECT * FROM e, r WHERE tenant = $1`,
		// now() read from a deleted row outside the DELETE
		`WITH gone AS (DELETE FROM i WHERE tenant = $1 RETURNING i.*) SELECT gone.key, now() FROM gone`,
		// now() outside CASE in a write, CASE without a clock
		`UPDATE e SET at = now(), s = CASE WHEN x THEN 'a' END WHERE tenant = $1`,
	} {
		require.Empty(t, sqlaudit.CitusRefusals(sql), sql)
	}
}
