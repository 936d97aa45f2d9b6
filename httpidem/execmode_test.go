package httpidem_test

import (
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/httpidem"
	"github.com/idemkit/idem/internal/pgtest"
)

// The middleware works in every pgx query mode, including exec and simple
// protocol, the modes behind PgBouncer in transaction mode (pgx then sends a
// []byte as bytea and learns no parameter types): a first run, its replay byte for
// byte, a mismatch, a stored client error and its replay, lease mode, and a request
// without a key on a route where it is optional.
func TestQueryExecModes(t *testing.T) {
	t.Parallel()
	for _, qm := range pgtest.QueryExecModes {
		t.Run(qm.String(), func(t *testing.T) {
			t.Parallel()
			b := setupOn(t, pgtest.Options{QueryExecMode: qm})
			first := b.post(t, "/payments", "k1", `{"amount": 12.50, "email": "a@example.com"}`, "X-Tenant", "acme")
			require.Equal(t, http.StatusCreated, first.Status, "%s", first)
			requireSameAnswer(t, first, b.post(t, "/payments", "k1", `{"email": "a@example.com", "amount": 12.5}`, "X-Tenant", "acme"))
			problem(t, b.post(t, "/payments", "k1", `{"amount": 12.51, "email": "a@example.com"}`, "X-Tenant", "acme"),
				http.StatusUnprocessableEntity, httpidem.CodeFingerprintMismatch)
			other := b.post(t, "/payments", "k1", `{"amount": 12.50, "email": "a@example.com"}`, "X-Tenant", "globex")
			require.Equal(t, http.StatusCreated, other.Status, "another tenant's key")

			refused := b.post(t, "/payments", "k2", `{"amount": -1}`)
			require.Equal(t, http.StatusUnprocessableEntity, refused.Status)
			requireSameAnswer(t, refused, b.post(t, "/payments", "k2", `{"amount": -1}`))
			require.Zero(t, b.count(t, `SELECT count(*) FROM audit`), "the refused request's work rolled back")

			leased := b.post(t, "/leased/payments", "k3", `{"amount": 3}`)
			require.Equal(t, http.StatusCreated, leased.Status, "%s", leased)
			requireSameAnswer(t, leased, b.post(t, "/leased/payments", "k3", `{"amount": 3}`))

			unkeyed := b.post(t, "/search", "", `{"amount": 4}`)
			require.Equal(t, http.StatusCreated, unkeyed.Status, "%s", unkeyed)

			require.Equal(t, 4, b.payments(t))
			require.EqualValues(t, 5, b.calls.Load())
			require.Equal(t, 4, b.count(t, `SELECT count(*) FROM effects`))
			var status int
			var body []byte
			require.NoError(t, b.pool.QueryRow(t.Context(), `SELECT response_status, response_body FROM inbox
				WHERE consumer = 'POST /payments' AND tenant = 'acme' AND key = 'k1'`).Scan(&status, &body))
			require.Equal(t, first.Status, status)
			require.Equal(t, first.Body, body, "the stored body, byte for byte")
		})
	}
}
