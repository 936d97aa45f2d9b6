package consumer_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
)

// series reads one metric from reg: a counter's value, or a histogram's sample
// count, summed over the series whose labels include want.
func series(t *testing.T, reg *prometheus.Registry, name string, want map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if !hasLabels(m, want) {
				continue
			}
			switch mf.GetType() {
			case dto.MetricType_COUNTER:
				sum += m.GetCounter().GetValue()
			case dto.MetricType_HISTOGRAM:
				sum += float64(m.GetHistogram().GetSampleCount())
			case dto.MetricType_GAUGE:
				sum += m.GetGauge().GetValue()
			}
		}
	}
	return sum
}

func hasLabels(m *dto.Metric, want map[string]string) bool {
	got := map[string]string{}
	for _, l := range m.GetLabel() {
		got[l.GetName()] = l.GetValue()
	}
	for k, v := range want {
		if got[k] != v {
			return false
		}
	}
	return true
}

// sentAt is the MessageTime of the tests: the "sent_at" metadata, RFC 3339.
func sentAt(msg *message.Message) (time.Time, bool) {
	at, err := time.Parse(time.RFC3339, msg.Metadata.Get("sent_at"))
	return at, err == nil
}

// TestMetricsCountEveryOutcome runs duplicates, a permanent failure and its replay,
// a mismatch, a transient failure and an expired retry, then scrapes the registry
// and checks every idem_inbox_* series.
func TestMetricsCountEveryOutcome(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, mode consumer.Mode) {
		c, b := setup(t, mode, func(cfg *consumer.Config) { cfg.MessageTime = sentAt })
		var transientOnce sync.Once
		h := c.Middleware(b.bizHandler(func(msg *message.Message) error {
			switch msg.UUID {
			case "declined":
				return consumer.Permanent(errors.New("card declined"))
			case "flaky":
				var err error
				transientOnce.Do(func() { err = errors.New("ledger timeout") })
				return err
			}
			return nil
		}))
		deliver := func(id, payload string) error {
			_, err := h(newMsg(id, payload))
			return err
		}
		// processed once, then two duplicates
		for range 3 {
			require.NoError(t, deliver("pay-1", `{"amount":1}`))
		}
		// the same key with another payload
		require.ErrorIs(t, deliver("pay-1", `{"amount":2}`), consumer.ErrFingerprintMismatch)
		// a permanent failure, recorded, then replayed on redelivery
		require.NoError(t, deliver("declined", `{}`))
		require.NoError(t, deliver("declined", `{}`))
		// transient, then processed
		require.Error(t, deliver("flaky", `{}`))
		require.NoError(t, deliver("flaky", `{}`))
		// older than the retention: counted, processed with a warning (the default)
		old := newMsg("old", `{}`)
		old.Metadata.Set("sent_at", time.Now().Add(-8*24*time.Hour).Format(time.RFC3339))
		_, err := h(old)
		require.NoError(t, err)

		name := map[string]string{"consumer": "payments"}
		for metric, want := range map[string]float64{
			"idem_inbox_processed_total":            3, // pay-1, flaky, old
			"idem_inbox_duplicates_total":           2,
			"idem_inbox_duplicate_age_seconds":      2, // one observation per duplicate
			"idem_inbox_fingerprint_mismatch_total": 1,
			"idem_inbox_failed_total":               2, // the failure and its replay
			"idem_inbox_expired_retry_total":        1,
			"idem_inbox_nacked_total":               1, // the transient failure
			// every claim: pay-1 x4, declined x2, flaky x2, old
			"idem_inbox_lock_wait_seconds": 9,
		} {
			require.Equal(t, want, series(t, b.reg, metric, name), metric)
		}
		require.Equal(t, 1.0, series(t, b.reg, "idem_inbox_failed_total", map[string]string{"code": "permanent", "replayed": "false"}))
		require.Equal(t, 1.0, series(t, b.reg, "idem_inbox_failed_total", map[string]string{"code": "permanent", "replayed": "true"}))
		require.Equal(t, 1.0, series(t, b.reg, "idem_inbox_nacked_total", map[string]string{"code": "transient"}))
		require.EqualValues(t, 5, b.calls.Load(), "pay-1, declined, flaky twice, old")
	})
}

// TestExpiredRetryFailPolicy: under FailExpiredRetry an old message is counted,
// recorded as failed and never handled.
func TestExpiredRetryFailPolicy(t *testing.T) {
	t.Parallel()
	c, b := setup(t, consumer.Transactional, func(cfg *consumer.Config) {
		cfg.MessageTime = sentAt
		cfg.FailExpiredRetry = true
	})
	h := c.Middleware(b.bizHandler(nil))
	old := newMsg("old", `{}`)
	old.Metadata.Set("sent_at", time.Now().Add(-8*24*time.Hour).Format(time.RFC3339))
	_, err := h(old)
	require.NoError(t, err, "recorded and acked")
	require.Zero(t, b.calls.Load())
	require.Equal(t, 1.0, series(t, b.reg, "idem_inbox_expired_retry_total", nil))
	require.Equal(t, 1.0, series(t, b.reg, "idem_inbox_failed_total", map[string]string{"code": "expired_retry"}))
	fresh := newMsg("fresh", `{}`)
	fresh.Metadata.Set("sent_at", time.Now().Add(-time.Hour).Format(time.RFC3339))
	_, err = h(fresh)
	require.NoError(t, err)
	require.EqualValues(t, 1, b.calls.Load())
	require.Equal(t, 1.0, series(t, b.reg, "idem_inbox_expired_retry_total", nil))
}

// TestLogsCarryKeyFieldsNotPayloads: every log line about a message names its
// consumer, tenant and key, and no line holds the payload.
func TestLogsCarryKeyFieldsNotPayloads(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	var mu sync.Mutex
	logger := slog.New(slog.NewJSONHandler(&lockedWriter{w: &buf, mu: &mu}, &slog.HandlerOptions{Level: slog.LevelDebug}))
	c, b := setup(t, consumer.Transactional, func(cfg *consumer.Config) {
		cfg.Logger = logger
		cfg.Tenant = consumer.MetadataKey("tenant")
		cfg.MessageTime = sentAt
	})
	h := c.Middleware(b.bizHandler(func(msg *message.Message) error {
		if msg.UUID == "declined" {
			return consumer.Permanent(errors.New("card declined"))
		}
		if msg.UUID == "flaky" {
			return errors.New("ledger timeout")
		}
		return nil
	}))
	const secret = "4111-1111-1111-1111"
	send := func(id, payload string) {
		m := newMsg(id, `{"card":"`+secret+`","v":"`+payload+`"}`)
		m.Metadata.Set("tenant", "acme")
		m.Metadata.Set("sent_at", time.Now().Add(-30*24*time.Hour).Format(time.RFC3339))
		_, _ = h(m)
	}
	send("pay-1", "a")
	send("pay-1", "a")    // duplicate (debug)
	send("pay-1", "b")    // mismatch (error)
	send("declined", "a") // permanent failure (warn)
	send("declined", "a") // replayed (info)
	send("flaky", "a")    // transient (info)

	mu.Lock()
	out := buf.String()
	mu.Unlock()
	require.NotContains(t, out, secret, "payloads are never logged")
	lines := strings.Split(strings.TrimSpace(out), "\n")
	require.Len(t, lines, 6+5, "an expired-retry warning per message, and one line per outcome but success")
	msgs := map[string]bool{}
	for _, line := range lines {
		var rec map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &rec), line)
		require.Equal(t, "payments", rec["consumer"], line)
		require.Equal(t, "acme", rec["tenant"], line)
		require.NotEmpty(t, rec["key"], line)
		msgs[rec["msg"].(string)] = true
	}
	for _, want := range []string{
		"idem: duplicate acked",
		"idem: key reused with a different payload",
		"idem: permanent failure recorded",
		"idem: redelivery of a failed key acked",
		"idem: transient failure, nacking",
		"idem: message older than the inbox retention; processing it, but its inbox row may be gone",
	} {
		require.True(t, msgs[want], "missing log %q in:\n%s", want, out)
	}
}

type lockedWriter struct {
	w  *bytes.Buffer
	mu *sync.Mutex
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
