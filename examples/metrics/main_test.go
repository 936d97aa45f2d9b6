package main

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
)

// TestExampleServesMetrics runs the example for a moment and scrapes /metrics.
func TestExampleServesMetrics(t *testing.T) {
	t.Parallel()
	pgtest.Require(t)
	schema := pgtest.NewSchemaName()
	t.Cleanup(func() { pgtest.DropSchema(t, schema) })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, config{databaseURL: pgtest.URL() + "&pool_max_conns=6", schema: schema, every: 5 * time.Millisecond},
			ln, slog.New(slog.DiscardHandler))
	}()
	defer func() {
		cancel()
		require.NoError(t, <-done)
	}()

	want := []string{
		"idem_inbox_processed_total{",
		"idem_inbox_duplicates_total{",
		"idem_inbox_duplicate_age_seconds_bucket{",
		"idem_inbox_failed_total{",
		"idem_inbox_lock_wait_seconds_bucket{",
		"idem_inbox_expired_retry_total{",
		"idem_effects_pending",
		"idem_effects_attempts_total{",
		"idem_effects_lag_seconds_bucket{",
		"idem_janitor_passes_total{",
		"watermill_handler_execution_time_seconds_bucket{",
		"go_goroutines",
	}
	var body string
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		body = scrape("http://" + ln.Addr().String() + "/metrics")
		if containsAll(body, want) {
			break
		}
	}
	for _, w := range want {
		require.Contains(t, body, w)
	}
}

func scrape(url string) string {
	resp, err := http.Get(url)
	if err != nil {
		return ""
	}
	defer func() { _ = resp.Body.Close() }()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

func containsAll(s string, subs []string) bool {
	for _, sub := range subs {
		if !strings.Contains(s, sub) {
			return false
		}
	}
	return true
}
