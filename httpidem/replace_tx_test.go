package httpidem_test

import (
	"context"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/httpidem"
	"github.com/idemkit/idem/internal/pgtest"
)

// A handler that ends idem's transaction with raw SQL and begins another leaves the
// connection in a transaction, so the transaction status alone cannot tell. These
// tests run such handlers behind a real server: the handler writes the payment and
// its effect, then ends the transaction ("COMMIT; BEGIN", "ROLLBACK; BEGIN", or
// "COMMIT" alone), writes an audit row in whatever transaction is open, and answers.
// idem must never commit the handler's replacement transaction (no audit row, ever),
// and the key is settled with a stored problem that every retry replays, never left
// without an answer and never run again: handler_committed if the handler's COMMIT
// committed the claim, handler_ended_transaction after its ROLLBACK.

// misbehave installs a hook that, on the handler's first call only, sends sql on
// the request's transaction, writes an audit row, and then does then (answer
// nothing special: return false; or answer itself).
func misbehave(t *testing.T, b *bundle, sql string, then func(w http.ResponseWriter) bool) {
	var done atomic.Bool
	b.setHook(func(w http.ResponseWriter, r *http.Request) bool {
		if !done.CompareAndSwap(false, true) {
			return false
		}
		tx := httpidem.Tx(r.Context())
		if _, err := tx.Exec(r.Context(), sql); err != nil {
			t.Errorf("%s: %v", sql, err)
		}
		_, _ = tx.Exec(r.Context(), `INSERT INTO audit (note) VALUES ('replacement')`)
		if then != nil {
			return then(w)
		}
		return false
	})
}

// requireSettledByHandler: the first answer is the stored handler_committed
// problem, a retry replays it byte for byte and runs nothing, the payment and
// effect the handler wrote before its COMMIT are there once, and the replacement
// transaction's audit row is not (after a COMMIT without BEGIN the audit row ran
// outside any transaction, committed at once: sql names what the handler sent).
func requireSettledByHandler(t *testing.T, b *bundle, sql, path, key string, first answer) {
	t.Helper()
	p := problem(t, first, http.StatusInternalServerError, httpidem.CodeHandlerCommitted)
	require.Contains(t, p.Detail, "retry")
	calls := b.calls.Load()
	replay := b.post(t, path, key, `{"amount": 1}`)
	requireSameAnswer(t, first, replay)
	require.Equal(t, calls, b.calls.Load(), "a settled key never runs again")
	require.Equal(t, 1, b.payments(t), "the work the handler committed itself")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM effects`))
	audit := 0
	if sql == "COMMIT" {
		audit = 1
	}
	require.Equal(t, audit, b.count(t, `SELECT count(*) FROM audit`), "the replacement transaction is rolled back")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM inbox WHERE key = $1 AND state = 'completed' AND response_status = 500
		AND error_code = 'handler_committed'`, key))
}

// requireEndedByHandler: the first answer is the stored handler_ended_transaction
// problem, a retry replays it byte for byte and runs nothing, the payment and
// effect the handler wrote before its ROLLBACK are rolled back, and so is the
// replacement transaction's audit row; the key is recorded as failed.
func requireEndedByHandler(t *testing.T, b *bundle, path, key string, first answer) {
	t.Helper()
	problem(t, first, http.StatusInternalServerError, httpidem.CodeHandlerEndedTransaction)
	calls := b.calls.Load()
	requireSameAnswer(t, first, b.post(t, path, key, `{"amount": 1}`))
	require.Equal(t, calls, b.calls.Load(), "a settled key never runs again")
	require.Equal(t, 0, b.payments(t))
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM effects`))
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM audit`), "the replacement transaction is rolled back")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM inbox WHERE key = $1 AND state = 'failed' AND response_status = 500
		AND error_code = 'handler_ended_transaction' AND lease_until IS NULL`, key))
}

// TestHandlerReplacesTransaction: transactional mode. A handler's COMMIT commits the
// claim with its first work; whatever it answers next (201, a final 422, a 503 that
// is not final, a panic), the key is settled with the stored handler_committed
// problem. A handler's ROLLBACK undoes the claim and its first work: the key is
// recorded as failed with the stored handler_ended_transaction problem.
func TestHandlerReplacesTransaction(t *testing.T) {
	t.Parallel()
	status := func(code int) func(w http.ResponseWriter) bool {
		return func(w http.ResponseWriter) bool {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(code)
			_, _ = w.Write([]byte(`{}`))
			return true
		}
	}
	for name, then := range map[string]func(w http.ResponseWriter) bool{
		"201": nil, "422": status(http.StatusUnprocessableEntity), "503": status(http.StatusServiceUnavailable),
	} {
		t.Run("commit;begin then "+name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			misbehave(t, b, "COMMIT; BEGIN", then)
			requireSettledByHandler(t, b, "COMMIT; BEGIN", "/payments", "k", b.post(t, "/payments", "k", `{"amount": 1}`))
		})
	}
	t.Run("commit;begin then panic", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		misbehave(t, b, "COMMIT; BEGIN", func(http.ResponseWriter) bool { panic("after its own commit") })
		_, err := b.tryPost(context.Background(), "/payments", "k", `{"amount": 1}`)
		require.Error(t, err, "net/http drops the connection of a panicking handler")
		a := b.post(t, "/payments", "k", `{"amount": 1}`)
		require.True(t, a.Replayed, "the retry gets the stored problem")
		require.Equal(t, http.StatusInternalServerError, a.Status)
		require.Contains(t, string(a.Body), httpidem.CodeHandlerCommitted)
		require.EqualValues(t, 1, b.calls.Load())
		require.Equal(t, 1, b.payments(t))
		require.Equal(t, 0, b.count(t, `SELECT count(*) FROM audit`))
	})
	t.Run("commit", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		misbehave(t, b, "COMMIT", nil)
		requireSettledByHandler(t, b, "COMMIT", "/payments", "k", b.post(t, "/payments", "k", `{"amount": 1}`))
	})
	t.Run("rollback;begin", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		misbehave(t, b, "ROLLBACK; BEGIN", nil)
		requireEndedByHandler(t, b, "/payments", "k", b.post(t, "/payments", "k", `{"amount": 1}`))
	})
	// Without a key there is nothing to settle, but idem still never commits the
	// handler's replacement transaction.
	t.Run("commit;begin without a key", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		misbehave(t, b, "COMMIT; BEGIN", nil)
		problem(t, b.post(t, "/search", "", `{"amount": 1}`), http.StatusInternalServerError, httpidem.CodeTransactionEnded)
		require.Equal(t, 1, b.payments(t), "committed by the handler itself")
		require.Equal(t, 0, b.count(t, `SELECT count(*) FROM audit`), "the replacement transaction is rolled back")
		require.Equal(t, 0, b.count(t, `SELECT count(*) FROM inbox`))
	})
}

// TestHandlerRollsBackUnderAConcurrentRequest: the handler's ROLLBACK frees the key,
// a concurrent request with the same key (waiting on the claim) runs and commits,
// and the first handler goes on in its replacement transaction. idem must not store
// the first handler's answer over the second's, nor commit the replacement: the key
// keeps the second request's answer and payment, which the first request gets too.
func TestHandlerRollsBackUnderAConcurrentRequest(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *httpidem.Config) { c.LockTimeout = 30 * time.Second })
	secondDone := make(chan struct{})
	var calls atomic.Int64
	b.setHook(func(w http.ResponseWriter, r *http.Request) bool {
		if calls.Add(1) != 1 {
			return false // the second request: an honest handler
		}
		ctx := r.Context()
		pgtest.WaitFor(t, 30*time.Second, "the second request to wait on the key", func() bool {
			return b.count(t, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND application_name = $1`, "idem-test:"+b.schema) == 1
		})
		tx := httpidem.Tx(ctx)
		if _, err := tx.Exec(ctx, "ROLLBACK; BEGIN"); err != nil {
			t.Errorf("ROLLBACK; BEGIN: %v", err)
		}
		select {
		case <-secondDone:
		case <-time.After(60 * time.Second):
			t.Error("the second request never finished")
		}
		_, _ = tx.Exec(ctx, `INSERT INTO audit (note) VALUES ('replacement')`)
		return false
	})
	firstc := make(chan answer, 1)
	go func() { firstc <- b.post(t, "/payments", "k", `{"amount": 1}`) }()
	pgtest.WaitFor(t, 30*time.Second, "the first request to hold the key", func() bool { return calls.Load() == 1 })
	second := b.post(t, "/payments", "k", `{"amount": 1}`)
	close(secondDone)
	require.Equal(t, http.StatusCreated, second.Status, "%s", second)
	require.Equal(t, "{\"id\":2,\"amount\":\"1\"}\n", string(second.Body), "id 1 was the rolled-back row's")
	requireSameAnswer(t, second, <-firstc)
	requireSameAnswer(t, second, b.post(t, "/payments", "k", `{"amount": 1}`))
	require.Equal(t, 1, b.payments(t))
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM audit`), "the replacement transaction is rolled back")
}

// TestLeaseHandlerReplacesTransaction: lease mode, where the key's row is committed
// before the handler runs and the handler's transaction is its own. A handler's
// COMMIT commits its first work outside the fence: the key is settled with the
// stored handler_committed problem, never released to run again. A handler's
// ROLLBACK commits nothing of idem's transaction, but what it writes after the
// ROLLBACK commits on its own: the key is recorded as failed with the stored
// handler_ended_transaction problem, never released to run again.
func TestLeaseHandlerReplacesTransaction(t *testing.T) {
	t.Parallel()
	for _, sql := range []string{"COMMIT; BEGIN", "COMMIT"} {
		t.Run(sql, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			misbehave(t, b, sql, nil)
			requireSettledByHandler(t, b, sql, "/leased/payments", "k", b.post(t, "/leased/payments", "k", `{"amount": 1}`))
			require.Equal(t, 1, b.count(t, `SELECT count(*) FROM inbox WHERE lease_until IS NULL`))
		})
	}
	t.Run("ROLLBACK; BEGIN", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		misbehave(t, b, "ROLLBACK; BEGIN", nil)
		requireEndedByHandler(t, b, "/leased/payments", "k", b.post(t, "/leased/payments", "k", `{"amount": 1}`))
	})
}
