package consumer

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/promreg"
)

// metrics are the consumer's Prometheus collectors. Several consumers in one process
// share them: the consumer label tells them apart.
type metrics struct {
	processed, duplicates, mismatch, failed, expiredRetry, transientNack *prometheus.CounterVec
	duplicateAge, lockWait                                               *prometheus.HistogramVec
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	f := promreg.With(reg)
	m := &metrics{
		processed:     f.Counter("idem_inbox_processed_total", "Messages whose handler work committed.", "consumer"),
		duplicates:    f.Counter("idem_inbox_duplicates_total", "Deliveries acked as duplicates of a committed key.", "consumer"),
		duplicateAge:  f.Histogram("idem_inbox_duplicate_age_seconds", "How long after the first commit a duplicate came; compare with the retention.", prometheus.ExponentialBuckets(0.01, 4, 14), "consumer"), // 10 ms .. ~28 days
		mismatch:      f.Counter("idem_inbox_fingerprint_mismatch_total", "Keys seen again with a different payload fingerprint.", "consumer"),
		failed:        f.Counter("idem_inbox_failed_total", "Permanent failures, by code; replayed=true for redeliveries of a recorded failure.", "consumer", "code", "replayed"),
		lockWait:      f.Histogram("idem_inbox_lock_wait_seconds", "Time from the start of a claim until it returned, including waits for a concurrent delivery of the key.", prometheus.ExponentialBuckets(0.0005, 4, 10), "consumer"),
		expiredRetry:  f.Counter("idem_inbox_expired_retry_total", "Deliveries older than the consumer's retention, or whose key's inbox row had expired (run as new).", "consumer"),
		transientNack: f.Counter("idem_inbox_nacked_total", "Deliveries nacked for a transient reason, by code.", "consumer", "code"),
	}
	if err := f.Err(); err != nil {
		return nil, err
	}
	return m, nil
}

// nackCodes are the codes idem itself nacks with (idem_inbox_nacked_total).
var nackCodes = []string{
	"transient", ErrBusy.Code(), ErrCommitUnknown.Code(), ErrCanceled.Code(), ErrClosed.Code(), ErrDatabaseUnavailable.Code(),
	ErrTxAborted.Code(), ErrBatchAborted.Code(), ErrMessageNotInBatch.Code(),
	inbox.ErrSchemaMissing.Code(), inbox.ErrLeaseLost.Code(),
}

// failCodes are the codes of idem's own permanent failures (idem_inbox_failed_total);
// replayable ones can also come back as replays of a recorded failure.
var (
	failCodes = []string{
		ErrBusinessKey.Code(), inbox.ErrEmptyKey.Code(), inbox.ErrKeyTooLong.Code(),
		inbox.ErrKeyInvalid.Code(), inbox.ErrTenantInvalid.Code(),
	}
	replayableFailCodes = []string{
		"permanent", inbox.ErrNotJSON.Code(), ErrExpiredRetry.Code(), ErrNoPublishTopic.Code(), ErrTxEnded.Code(),
	}
)

// init makes every series of one consumer exist at zero, so that a dashboard's
// rate() and an alert on increase() see them from the start, not from the first
// increment. Codes a handler invents still appear at their first use.
func (m *metrics) init(name string) {
	promreg.Zero([]string{name}, m.processed.MetricVec, m.duplicates.MetricVec, m.duplicateAge.MetricVec,
		m.mismatch.MetricVec, m.lockWait.MetricVec, m.expiredRetry.MetricVec)
	for _, code := range nackCodes {
		m.transientNack.WithLabelValues(name, code)
	}
	for _, code := range failCodes {
		m.failed.WithLabelValues(name, code, "false")
	}
	for _, code := range replayableFailCodes {
		m.failed.WithLabelValues(name, code, "false")
		m.failed.WithLabelValues(name, code, "true")
	}
}
