package consumer_test

// The consumer's metric series.

import (
	"slices"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/pgtest"
)

// Every series a dashboard needs exists at zero
// before the first message: at New when Config.Name is set, and at a name's first
// message when the name comes from the Watermill handler.
func TestMetricSeriesExistFromTheStart(t *testing.T) {
	t.Parallel()
	want := []struct {
		name   string
		labels map[string]string
	}{
		{"idem_inbox_processed_total", nil},
		{"idem_inbox_duplicates_total", nil},
		{"idem_inbox_duplicate_age_seconds", nil},
		{"idem_inbox_fingerprint_mismatch_total", nil},
		{"idem_inbox_lock_wait_seconds", nil},
		{"idem_inbox_expired_retry_total", nil},
		{"idem_inbox_failed_total", map[string]string{"code": "permanent", "replayed": "false"}},
		{"idem_inbox_failed_total", map[string]string{"code": "permanent", "replayed": "true"}},
		{"idem_inbox_failed_total", map[string]string{"code": "business_key", "replayed": "false"}},
		{"idem_inbox_nacked_total", map[string]string{"code": "transient"}},
		{"idem_inbox_nacked_total", map[string]string{"code": "busy"}},
		{"idem_inbox_nacked_total", map[string]string{"code": "commit_unknown"}},
		{"idem_inbox_nacked_total", map[string]string{"code": "database_unavailable"}},
		{"idem_inbox_nacked_total", map[string]string{"code": "message_not_in_batch"}},
		{"idem_inbox_failed_total", map[string]string{"code": "handler_ended_transaction", "replayed": "false"}},
		{"idem_inbox_failed_total", map[string]string{"code": "handler_ended_transaction", "replayed": "true"}},
		{"idem_inbox_nacked_total", map[string]string{"code": "schema_missing"}},
	}
	check := func(t *testing.T, b *bundle, consumerName string) {
		t.Helper()
		mfs, err := b.reg.Gather()
		require.NoError(t, err)
		for _, w := range want {
			labels := map[string]string{"consumer": consumerName}
			for k, v := range w.labels {
				labels[k] = v
			}
			found := slices.ContainsFunc(mfs, func(mf *dto.MetricFamily) bool {
				return mf.GetName() == w.name && slices.ContainsFunc(mf.GetMetric(), func(m *dto.Metric) bool { return hasLabels(m, labels) })
			})
			require.True(t, found, "series %s%v missing", w.name, labels)
		}
	}
	forAllModes(t, func(t *testing.T, mode consumer.Mode) {
		t.Run("Name set", func(t *testing.T) {
			_, b := setup(t, mode)
			check(t, b, "payments") // before any message
			require.Zero(t, series(t, b.reg, "idem_inbox_processed_total", nil))
		})
		t.Run("Name from the handler", func(t *testing.T) {
			c, b := setup(t, mode, func(cfg *consumer.Config) { cfg.Name = "" })
			pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, watermill.NopLogger{})
			defer func() { require.NoError(t, pubsub.Close()) }()
			runRouter(t, pubsub, b.bizHandler(nil), c.Middleware)
			require.NoError(t, pubsub.Publish("in", message.NewMessage("first", []byte(`{}`))))
			pgtest.WaitFor(t, time.Minute, "the first message", func() bool { return b.counter("idem_inbox_processed_total") == 1 })
			check(t, b, "payments") // the router's handler name
			require.Zero(t, series(t, b.reg, "idem_inbox_duplicates_total", nil))
		})
	})
}
