package effectsdb

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/sqlaudit"
)

// TestStatementsNameOneTenant is the static audit of the enqueue and requeue
// statements (every string field of queries, including ones added later): each
// names one tenant (tenant = $n, or a tenant inserted from one bind parameter)
// unless listed here with why. The statement audit in internal/sqlaudit checks what
// is actually sent.
func TestStatementsNameOneTenant(t *testing.T) {
	t.Parallel()
	require.Empty(t, sqlaudit.CheckFields(newQueries("idem"), map[string]string{
		"insertMany":    "a write of several tenants' effects (insertManyOne names one)",
		"fingerprintOf": "a read of several tenants' effects (fingerprintOfOne names one)",
		"requeue":       "an operator's requeue, across tenants unless it names one",
		"notify":        "NOTIFY names a channel, and runs on the coordinator",
	}))
}

// The enqueue statements of one tenant's effects break none of Citus's rules
// (sqlaudit.CitusRefusals), so they run on a Citus worker as they are.
func TestOneTenantStatementsTakeCitusRules(t *testing.T) {
	t.Parallel()
	q := newQueries("idem")
	for name, sql := range map[string]string{
		"insert": q.insert, "insertRouted": q.insertRouted, "insertManyOne": q.insertManyOne, "fingerprintOfOne": q.fingerprintOfOne,
	} {
		require.Empty(t, sqlaudit.CitusRefusals(sql), name)
	}
}
