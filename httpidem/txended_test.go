package httpidem_test

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/httpidem"
	"github.com/idemkit/idem/internal/pgtest"
)

// TestHandlerEndingTheTransactionRunsOnce: a handler that ends idem's transaction
// with a raw ROLLBACK (and perhaps a BEGIN after) and goes on writing has its
// writes after the ROLLBACK committed on their own, whatever it answers. Running it
// again would write them twice, so the key is recorded as failed with a stored 500
// handler_ended_transaction problem: the retry gets it, replayed, and the handler
// never runs again. Both modes, 2xx, a final 4xx and a 5xx that is not final, on
// a pool of one connection, where settling the key on a second connection would
// wait forever.
func TestHandlerEndingTheTransactionRunsOnce(t *testing.T) {
	t.Parallel()
	b := setupPooled(t, 1)
	b.setHook(func(w http.ResponseWriter, r *http.Request) bool {
		ctx := r.Context()
		tx := httpidem.Tx(ctx)
		if _, err := tx.Exec(ctx, "ROLLBACK"); err != nil {
			t.Errorf("ROLLBACK: %v", err)
		}
		// Outside any transaction: committed at once.
		if _, err := tx.Exec(ctx, `INSERT INTO payments (tenant, amount) VALUES ($1, 7)`, r.Header.Get("X-Tenant")); err != nil {
			t.Errorf("INSERT after ROLLBACK: %v", err)
		}
		if r.Header.Get("X-Begin") != "" {
			// The handler's own transaction, which idem rolls back.
			for _, sql := range []string{"BEGIN", `INSERT INTO audit (note) VALUES ('after begin')`} {
				if _, err := tx.Exec(ctx, sql); err != nil {
					t.Errorf("%s: %v", sql, err)
				}
			}
		}
		status, _ := strconv.Atoi(r.Header.Get("X-Status"))
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_, _ = w.Write([]byte(`{"id":"p1"}`))
		return true
	})
	for _, path := range []string{"/payments", "/leased/payments"} {
		for _, begin := range []string{"", "then BEGIN"} {
			for _, status := range []int{http.StatusCreated, http.StatusUnprocessableEntity, http.StatusServiceUnavailable} {
				tenant := fmt.Sprintf("t%s-%t-%d", path[1:2], begin != "", status)
				t.Run(fmt.Sprintf("%s ROLLBACK %s %d", path, begin, status), func(t *testing.T) {
					hdr := []string{"X-Tenant", tenant, "X-Status", strconv.Itoa(status), "X-Begin", begin}
					ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
					defer cancel()
					calls := b.calls.Load()
					first, err := b.tryPost(ctx, path, "k", `{"amount": 1}`, hdr...)
					require.NoError(t, err, "answered on a pool of one connection")
					retry, err := b.tryPost(ctx, path, "k", `{"amount": 1}`, hdr...)
					require.NoError(t, err, "answered on a pool of one connection")
					require.Equal(t, 1, b.count(t, `SELECT count(*) FROM payments WHERE tenant = $1`, tenant),
						"the row written after the ROLLBACK, once; the one before it rolled back")
					require.Equal(t, calls+1, b.calls.Load(), "the retry never runs the handler")
					p := problem(t, first, http.StatusInternalServerError, httpidem.CodeHandlerEndedTransaction)
					require.Contains(t, p.Detail, "will not run again")
					requireSameAnswer(t, first, retry)

					require.Zero(t, b.count(t, `SELECT count(*) FROM effects WHERE source_tenant = $1`, tenant), "rolled back by the handler")
					require.Equal(t, 1, b.count(t, `SELECT count(*) FROM inbox WHERE tenant = $1 AND key = 'k' AND state = 'failed'
						AND error_code = 'handler_ended_transaction' AND response_status = 500 AND lease_until IS NULL`, tenant))
					pgtest.WaitFor(t, 10*time.Second, "the connection back in the pool", func() bool { return b.mwPool.Stat().AcquiredConns() == 0 })
				})
			}
		}
	}
	require.Zero(t, b.count(t, `SELECT count(*) FROM audit`), "the handler's own transaction is rolled back")
}

// TestFailedStatementIsNotEndedTransaction: a statement that fails inside idem's
// transaction (a unique violation) leaves it failed, not ended: Postgres rolls it
// back whole and nothing of the handler's work commits. A 500 answer is sent as it
// is and settles nothing: the retry runs the handler again. A final 422, the
// handler's answer to the violation it caught, is stored like any other final
// client error (its work is rolled back either way): the retry gets it replayed
// and the handler never runs again. Both modes, on a pool of one connection.
func TestFailedStatementIsNotEndedTransaction(t *testing.T) {
	t.Parallel()
	b := setupPooled(t, 1)
	_, err := b.pool.Exec(context.Background(), `INSERT INTO payments (id, tenant, amount) VALUES (1000000, 'seed', 1)`)
	require.NoError(t, err)
	b.setHook(func(w http.ResponseWriter, r *http.Request) bool {
		ctx := r.Context()
		_, err := httpidem.Tx(ctx).Exec(ctx, `INSERT INTO payments (id, tenant, amount) VALUES (1000000, 'dup', 1)`)
		if err == nil {
			t.Error("the duplicate payment was inserted")
		}
		status, _ := strconv.Atoi(r.Header.Get("X-Status"))
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(status)
		_, _ = w.Write([]byte("duplicate"))
		return true
	})
	for _, path := range []string{"/payments", "/leased/payments"} {
		for _, status := range []int{http.StatusInternalServerError, http.StatusUnprocessableEntity} {
			tenant := fmt.Sprintf("f%s-%d", path[1:2], status)
			t.Run(fmt.Sprintf("%s %d", path, status), func(t *testing.T) {
				hdr := []string{"X-Tenant", tenant, "X-Status", strconv.Itoa(status)}
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				defer cancel()
				calls := b.calls.Load()
				var answers []answer
				for range 2 {
					a, err := b.tryPost(ctx, path, "k", `{"amount": 1}`, hdr...)
					require.NoError(t, err, "answered on a pool of one connection")
					answers = append(answers, a)
				}
				first, retry := answers[0], answers[1]
				require.Equal(t, status, first.Status, "%s", first)
				require.Equal(t, "duplicate", string(first.Body))
				require.False(t, first.Replayed)
				if status == http.StatusUnprocessableEntity {
					requireSameAnswer(t, first, retry)
					require.Equal(t, calls+1, b.calls.Load(), "the retry gets the stored 422")
					require.Equal(t, 1, b.count(t, `SELECT count(*) FROM inbox WHERE tenant = $1 AND key = 'k' AND state = 'failed'
						AND error_code = 'http_422' AND response_status = 422 AND response_body = 'duplicate' AND lease_until IS NULL`, tenant))
				} else {
					require.Equal(t, first, retry, "not stored: the retry runs again and answers alike")
					require.Equal(t, calls+2, b.calls.Load(), "the retry runs the handler again")
					require.Zero(t, b.count(t, `SELECT count(*) FROM inbox WHERE tenant = $1 AND state <> 'processing'`, tenant), "the key is not settled")
					if path == "/leased/payments" {
						require.Equal(t, 1, b.count(t, `SELECT count(*) FROM inbox WHERE tenant = $1 AND lease_until <= now()`, tenant), "the lease was given back")
					}
				}
				require.Zero(t, b.count(t, `SELECT count(*) FROM payments WHERE tenant = $1`, tenant), "rolled back")
				require.Zero(t, b.count(t, `SELECT count(*) FROM effects WHERE source_tenant = $1`, tenant), "rolled back")
				pgtest.WaitFor(t, 10*time.Second, "the connection back in the pool", func() bool { return b.mwPool.Stat().AcquiredConns() == 0 })
			})
		}
	}
	require.Equal(t, 1, b.payments(t), "the seed alone")
}
