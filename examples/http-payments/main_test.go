package main

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
)

// TestHTTPPayments runs the program against the test Postgres: a payment posted
// three times with one key (bare, and in the draft's quoted form with a
// parameter) is one payment, one answer (replayed byte for byte, Cache-Control
// included), one receipt email and one ledger row; the same key with another
// amount is 422; a missing key is 400, and so is a request without an account; a
// GET with a key passes through.
func TestHTTPPayments(t *testing.T) {
	t.Parallel()
	pgtest.Require(t)
	schema := pgtest.NewSchemaName()
	t.Cleanup(func() { pgtest.DropSchema(t, schema) })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var mu sync.Mutex
	mails := map[string]int{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, Config{DatabaseURL: pgtest.URL() + "&pool_max_conns=6", Schema: schema, Logger: slog.New(slog.DiscardHandler),
			OnMail: func(to, id string) { mu.Lock(); mails[id]++; mu.Unlock() }}, ln)
	}()
	defer func() {
		cancel()
		require.NoError(t, <-done)
	}()
	base := "http://" + ln.Addr().String()
	client := &http.Client{Timeout: 30 * time.Second}
	defer client.CloseIdleConnections()

	account := "acct_1"
	// post sends a payment and returns the answer's status and header, and its body.
	type answer struct {
		StatusCode int
		Header     http.Header
	}
	post := func(key, body string) (answer, []byte) {
		req, err := http.NewRequest(http.MethodPost, base+"/payments", strings.NewReader(body))
		require.NoError(t, err)
		req.Header.Set("Content-Type", "application/json")
		if account != "" {
			req.Header.Set("X-Account", account)
		}
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		var resp *http.Response
		for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			if resp, err = client.Do(req); err == nil || time.Now().After(deadline) {
				break
			}
			req.Body = io.NopCloser(strings.NewReader(body)) // the server is still starting
		}
		require.NoError(t, err)
		defer func() { require.NoError(t, resp.Body.Close()) }()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return answer{resp.StatusCode, resp.Header}, b
	}

	body := `{"amount": "12.50", "currency": "EUR", "email": "ann@example.com"}`
	first, firstBody := post("9b2f0c1e-1111-4c1a-9a57-1c0ffee00001", body)
	require.Equal(t, http.StatusCreated, first.StatusCode, string(firstBody))
	var p Payment
	require.NoError(t, json.Unmarshal(firstBody, &p))
	require.True(t, strings.HasPrefix(p.ID, "pay_"))
	require.Equal(t, "no-store", first.Header.Get("Cache-Control"))
	for _, key := range []string{"9b2f0c1e-1111-4c1a-9a57-1c0ffee00001", `"9b2f0c1e-1111-4c1a-9a57-1c0ffee00001";v=1`} {
		again, againBody := post(key, `{"email":"ann@example.com","currency":"EUR","amount":"12.50"}`)
		require.Equal(t, http.StatusCreated, again.StatusCode, key)
		require.Equal(t, "true", again.Header.Get("Idempotent-Replayed"), key)
		require.Equal(t, firstBody, againBody, key)
		require.Equal(t, first.Header.Get("Location"), again.Header.Get("Location"), key)
		require.Equal(t, "no-store", again.Header.Get("Cache-Control"), key)
	}
	mismatch, mismatchBody := post("9b2f0c1e-1111-4c1a-9a57-1c0ffee00001", `{"amount": "12.51", "currency": "EUR", "email": "ann@example.com"}`)
	require.Equal(t, http.StatusUnprocessableEntity, mismatch.StatusCode)
	require.Contains(t, string(mismatchBody), `"code":"fingerprint_mismatch"`)
	missing, missingBody := post("", body)
	require.Equal(t, http.StatusBadRequest, missing.StatusCode)
	require.Contains(t, string(missingBody), `"code":"idempotency_key_missing"`)
	account = ""
	anonymous, anonymousBody := post("9b2f0c1e-3333-4c1a-9a57-1c0ffee00003", body)
	require.Equal(t, http.StatusBadRequest, anonymous.StatusCode)
	require.Contains(t, string(anonymousBody), `"code":"tenant_invalid"`)
	account = "acct_1"
	invalid, invalidBody := post("9b2f0c1e-2222-4c1a-9a57-1c0ffee00002", `{"amount": "-1", "currency": "EUR", "email": "ann@example.com"}`)
	require.Equal(t, http.StatusUnprocessableEntity, invalid.StatusCode)
	require.Contains(t, string(invalidBody), "positive")

	// The Dispatcher sends the receipt once and publishes payments.created, which
	// the consumer books once. The consumer may book before the Dispatcher has
	// marked the publish effect done, so the wait covers both effects.
	pool := pgtest.NewPool(t, schema, 2)
	pgtest.WaitFor(t, 30*time.Second, "the payment booked in the ledger and both effects done", func() bool {
		var booked, done bool
		err := pool.QueryRow(context.Background(), `SELECT
			(SELECT count(*) >= 1 FROM ledger WHERE payment_id = $1),
			(SELECT count(*) >= 2 FROM effects WHERE state = 'done')`, p.ID).Scan(&booked, &done)
		mu.Lock()
		defer mu.Unlock()
		return err == nil && booked && done && len(mails) >= 1
	})
	require.Equal(t, 1, count(t, pool, `SELECT count(*) FROM ledger WHERE payment_id = $1`, p.ID), "booked once")
	require.Equal(t, 1, count(t, pool, `SELECT count(*) FROM payments`))
	require.Equal(t, 2, count(t, pool, `SELECT count(*) FROM effects WHERE state = 'done'`))
	mu.Lock()
	require.Equal(t, map[string]int{"<receipt." + p.ID + "@payments.example.com>": 1}, mails)
	mu.Unlock()

	get, err := http.NewRequest(http.MethodGet, base+"/payments/"+p.ID, nil)
	require.NoError(t, err)
	get.Header.Set("Idempotency-Key", "9b2f0c1e-1111-4c1a-9a57-1c0ffee00001") // ignored: a read passes through
	resp, err := client.Do(get)
	require.NoError(t, err)
	require.Empty(t, resp.Header.Get("Idempotent-Replayed"))
	defer func() { require.NoError(t, resp.Body.Close()) }()
	var shown Payment
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&shown))
	require.True(t, *shown.Booked)
	require.Equal(t, "12.50", shown.Amount)
}

func count(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) int {
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}
