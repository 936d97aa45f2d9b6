package effects

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/sqlaudit"
)

// TestStatementsNameOneTenant is the static audit of the package's statements
// (every string field of queries, including ones added later; internal/effectsdb
// audits the enqueue and requeue statements):
// each names one tenant (tenant = $n, or a tenant inserted from one bind
// parameter) unless listed here with why. The statement audit in internal/sqlaudit
// checks what is actually sent.
func TestStatementsNameOneTenant(t *testing.T) {
	t.Parallel()
	mixed := map[string]string{
		"claim":       "the Dispatcher without Config.Tenant claims every tenant's effects",
		"record":      "an outcome batch of several tenants (recordOne names one)",
		"recordAgain": "an outcome batch of several tenants, retried (recordAgainOne names one)",
		"notify":      "NOTIFY names a channel",
		"pending":     "the pending gauge counts every tenant's effects",
	}
	require.Empty(t, sqlaudit.CheckFields(newQueries("idem", 100, false), mixed))
	filtered := map[string]string{}
	for name, why := range mixed {
		if name != "claim" {
			filtered[name] = why
		}
	}
	require.Empty(t, sqlaudit.CheckFields(newQueries("idem", 100, true), filtered), "a Dispatcher with a Tenant claims with tenant = $4")
}

// The Dispatcher's statements of one tenant's effects break none of Citus's rules
// (sqlaudit.CitusRefusals), so they run on a Citus worker as they are.
func TestOneTenantStatementsTakeCitusRules(t *testing.T) {
	t.Parallel()
	q := newQueries("idem", 100, true)
	for name, sql := range map[string]string{
		"claim": q.claim, "claimCitus": q.claimCitus, "recordOne": q.recordOne, "recordAgainOne": q.recordAgainOne,
	} {
		require.Empty(t, sqlaudit.CitusRefusals(sql), name)
	}
}
