package main

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/httpidem"
)

// TestInspectHTTPKey: an HTTP key is an inbox record under its operation, and
// inspect shows whether a response is stored (its status, headers and body size,
// never the body), with the effects the request made.
func TestInspectHTTPKey(t *testing.T) {
	b := setup(t)
	mw, err := httpidem.New(httpidem.Config{Pool: b.pool, Schema: b.schema,
		Tenant: func(r *http.Request) (string, error) { return "acct_42", nil }})
	require.NoError(t, err)
	mux := http.NewServeMux()
	mux.Handle("POST /payments", mw.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		if _, err := effects.Enqueue(ctx, httpidem.Tx(ctx), effects.Effect{Kind: "email", Key: "receipt:pay_1", Payload: []byte(`{}`)}); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/payments/pay_1")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"id":"pay_1","email":"ann@example.com"}`))
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/payments", strings.NewReader(`{"amount":1}`))
	req.Header.Set("Idempotency-Key", "k-1")
	resp, err := srv.Client().Do(req)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	require.Equal(t, http.StatusCreated, resp.StatusCode)

	r := b.idem("inspect", "--consumer", "POST /payments", "--tenant", "acct_42", "--key", "k-1").ok(t)
	require.Regexp(t, `state\s+completed`, r.stdout)
	require.Regexp(t, `response\s+201, body 40 bytes, headers Content-Type, Location`, r.stdout)
	require.NotContains(t, r.stdout, "ann@example.com", "the body is not shown")
	require.Regexp(t, `email\s+receipt:pay_1\s+pending`, r.stdout)

	var rec admin.Inspection
	b.idem("inspect", "--consumer", "POST /payments", "--tenant", "acct_42", "--key", "k-1", "--json").ok(t).decode(t, &rec)
	require.Equal(t, &admin.Response{Status: 201, BodyBytes: 40,
		Headers: map[string][]string{"Content-Type": {"application/json"}, "Location": {"/payments/pay_1"}}}, rec.Response)

	// A message consumer's key has no response.
	b.process("acme", "pay-9", `{}`)
	var msgRec admin.Inspection
	b.idem("inspect", "--consumer", "payments", "--tenant", "acme", "--key", "pay-9", "--json").ok(t).decode(t, &msgRec)
	require.Nil(t, msgRec.Response)
	require.NotContains(t, b.idem("inspect", "--consumer", "payments", "--tenant", "acme", "--key", "pay-9").ok(t).stdout, "response")
}
