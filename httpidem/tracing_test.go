package httpidem_test

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/httpidem"
)

// A keyed request's claim, handler and commit have spans under the request's own
// span (a server span, as otelhttp makes); the effect the handler enqueues keeps
// the handler span's trace context; a retry's claim says it was replayed. Lease
// mode too.
func TestTracing(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	b := setup(t, func(c *httpidem.Config) { c.TracerProvider = tp })
	// The server span, as an HTTP tracing middleware outside idem would start it.
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, span := tp.Tracer("http").Start(r.Context(), "POST "+r.URL.Path, trace.WithSpanKind(trace.SpanKindServer))
		defer span.End()
		b.srv.Config.Handler.ServeHTTP(w, r.WithContext(ctx))
	}))
	t.Cleanup(srv.Close)

	for _, path := range []string{"/payments", "/leased/payments"} {
		key := "trace" + path
		a, err := postTo(context.Background(), b.client, srv.URL, path, key, `{"amount": 5, "email": "a@example.com"}`, "X-Tenant", "acme")
		require.NoError(t, err)
		require.Equal(t, http.StatusCreated, a.Status, path)
		server := lastSpan(t, rec, "POST "+path)
		kids := childrenOf(rec, server.SpanContext())
		require.Contains(t, kids, "idem.claim", path)
		require.Contains(t, kids, "idem.handler", path)
		require.Contains(t, kids, "idem.commit", path)
		claim := kids["idem.claim"]
		require.Equal(t, "claimed", spanAttr(claim, "idem.outcome"))
		require.Equal(t, key, spanAttr(claim, "idem.key"))
		require.Equal(t, "acme", spanAttr(claim, "idem.tenant"))
		handler := kids["idem.handler"].SpanContext()
		var raw string
		require.NoError(t, b.pool.QueryRow(context.Background(),
			`SELECT trace_context::text FROM effects WHERE source_key = $1`, key).Scan(&raw))
		var tc map[string]string
		require.NoError(t, json.Unmarshal([]byte(raw), &tc))
		require.Equal(t, "00-"+handler.TraceID().String()+"-"+handler.SpanID().String()+"-01", tc["traceparent"],
			"%s: the effect keeps the handler span's trace context", path)

		// The retry is answered from the store.
		_, err = postTo(context.Background(), b.client, srv.URL, path, key, `{"amount": 5, "email": "a@example.com"}`, "X-Tenant", "acme")
		require.NoError(t, err)
		retry := childrenOf(rec, lastSpan(t, rec, "POST "+path).SpanContext())
		require.Equal(t, "replayed", spanAttr(retry["idem.claim"], "idem.outcome"), path)
		require.NotContains(t, retry, "idem.handler", path)
	}
}

// Without a recording span in the request's context (no tracing middleware in
// front of idem), idem makes no spans of its own, even with a provider that
// records: they would each be the root of a trace of their own.
func TestNoSpansWithoutARequestSpan(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	b := setup(t, func(c *httpidem.Config) { c.TracerProvider = tp })
	for _, path := range []string{"/payments", "/leased/payments"} {
		require.Equal(t, http.StatusCreated, b.post(t, path, "k", `{"amount": 5}`).Status, path)
	}
	require.Empty(t, rec.Ended())
	require.Equal(t, 2, b.count(t, `SELECT count(*) FROM effects WHERE trace_context IS NULL`), "nothing traced, nothing stored")
}

func lastSpan(t *testing.T, rec *tracetest.SpanRecorder, name string) sdktrace.ReadOnlySpan {
	t.Helper()
	var last sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		if s.Name() == name {
			last = s
		}
	}
	require.NotNil(t, last, name)
	return last
}

func childrenOf(rec *tracetest.SpanRecorder, parent trace.SpanContext) map[string]sdktrace.ReadOnlySpan {
	out := map[string]sdktrace.ReadOnlySpan{}
	for _, s := range rec.Ended() {
		if s.Parent().SpanID() == parent.SpanID() {
			out[s.Name()] = s
		}
	}
	return out
}

func spanAttr(s sdktrace.ReadOnlySpan, key string) string {
	for _, kv := range s.Attributes() {
		if string(kv.Key) == key {
			return kv.Value.String()
		}
	}
	return ""
}
