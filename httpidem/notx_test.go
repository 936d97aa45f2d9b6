package httpidem_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/httpidem"
	"github.com/idemkit/idem/internal/errcode"
)

// Outside httpidem's middleware Tx panics with ErrNoTx, whose text names the
// mistake and the fix, and TxSafely returns it, with the consumer's code; a safe
// method passed through untouched has no transaction either.
func TestTxOutsideMiddleware(t *testing.T) {
	t.Parallel()
	tx, err := httpidem.TxSafely(context.Background())
	require.Nil(t, tx)
	require.ErrorIs(t, err, httpidem.ErrNoTx)
	require.Equal(t, "no_transaction", errcode.Code(err))
	require.Contains(t, err.Error(), "httpidem's middleware is not around this handler")

	var got any
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer func() { got = recover() }()
		_ = httpidem.Tx(r.Context())
	})
	h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader("{}")))
	perr, ok := got.(error)
	require.True(t, ok, "Tx panics with an error, not %T", got)
	require.ErrorIs(t, perr, httpidem.ErrNoTx)

	b := setup(t)
	safeErr, postErr := errors.New("not run"), errors.New("not run")
	probe := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, err := httpidem.TxSafely(r.Context())
		if r.Method == http.MethodGet {
			safeErr = err
		} else {
			postErr = err
		}
	})
	mux := http.NewServeMux()
	mux.Handle("/probe", b.mw.Middleware(probe))
	mux.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodGet, "/probe", nil))
	require.ErrorIs(t, safeErr, httpidem.ErrNoTx, "a passed-through GET has no transaction")
	req := httptest.NewRequest(http.MethodPost, "/probe", strings.NewReader("{}"))
	req.Header.Set("Idempotency-Key", "k-1")
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Tenant", "t0")
	rec := httptest.NewRecorder()
	mux.ServeHTTP(rec, req)
	require.Equal(t, http.StatusOK, rec.Code, rec.Body.String())
	require.NoError(t, postErr, "a keyed POST runs in a transaction")
}
