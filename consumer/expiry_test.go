package consumer_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/pgtest"
)

// expiryPath is one way a message reaches the inbox: a mode's Middleware, or a
// batch handler.
type expiryPath struct {
	name  string
	mode  consumer.Mode
	batch bool
}

var expiryPaths = []expiryPath{
	{"Transactional", consumer.Transactional, false},
	{"Lease", consumer.Lease, false},
	{"GroupCommit", consumer.GroupCommit, false},
	{"HandleBatch", consumer.Transactional, true},
	{"HandleBatch/GroupCommit", consumer.GroupCommit, true},
}

// handlerFor returns a delivery function for path: the message handler writes one
// business row (bizHandler), the batch handler one per message (batchBiz).
func handlerFor(t *testing.T, p expiryPath, mutate ...func(*consumer.Config)) (func(*message.Message) error, *bundle) {
	t.Helper()
	c, b := setup(t, p.mode, append([]func(*consumer.Config){batched}, mutate...)...)
	if p.batch {
		bb := &batchBiz{b: b}
		return c.HandleBatch(bb.handle), b
	}
	return middlewareFunc(c.Middleware(b.bizHandler(nil))), b
}

// A key whose inbox row is past its expires_at is forgotten, in every mode and in a
// batch handler, whether or not the janitor has deleted the row yet: the message
// runs as new, is counted in idem_inbox_expired_retry_total, and its row is
// replaced by a fresh one. A row that has not expired still makes a duplicate (or
// a replay, or a mismatch).
func TestExpiredKeyIsForgottenInEveryMode(t *testing.T) {
	t.Parallel()
	type row struct {
		state   string // completed or failed
		payload string // the payload the row's fingerprint is of
		expired bool
	}
	cases := []struct {
		name string
		row  row
		// runs: the delivery runs the handler as new; otherwise it is answered
		// from the row.
		runs bool
	}{
		{"completed, expired", row{"completed", `{"n":1}`, true}, true},
		{"failed, expired", row{"failed", `{"n":1}`, true}, true},
		{"other payload, expired", row{"completed", `{"n":2}`, true}, true},
		{"completed, live", row{"completed", `{"n":1}`, false}, false},
		{"failed, live", row{"failed", `{"n":1}`, false}, false},
	}
	for _, p := range expiryPaths {
		for _, tc := range cases {
			t.Run(p.name+"/"+tc.name, func(t *testing.T) {
				t.Parallel()
				h, b := handlerFor(t, p)
				ctx := context.Background()
				expiresAt := "now() + interval '1 day'"
				if tc.row.expired {
					expiresAt = "now() - interval '1 second'"
				}
				_, err := b.pool.Exec(ctx, `INSERT INTO inbox (consumer, key, fingerprint, state, received_at, completed_at, expires_at, error_code, error)
					VALUES ('payments', 'k', $1, $2, now() - interval '8 days', now() - interval '8 days', `+expiresAt+`,
						CASE WHEN $2 = 'failed' THEN 'permanent' END, CASE WHEN $2 = 'failed' THEN 'declined' END)`,
					mustFP(tc.row.payload), tc.row.state)
				require.NoError(t, err)

				err = h(newMsg("k", `{"n":1}`))
				mismatch := tc.row.payload != `{"n":1}`
				if !tc.runs && mismatch {
					require.ErrorIs(t, err, consumer.ErrFingerprintMismatch)
				} else {
					require.NoError(t, err)
				}

				if !tc.runs {
					require.Zero(t, b.bizRows(t, "k"), "a live row answers the message")
					require.Zero(t, b.counter("idem_inbox_expired_retry_total"))
					require.Equal(t, 1, pgtest.Count(t, b.pool,
						`SELECT count(*) FROM inbox WHERE key = 'k' AND received_at < now() - interval '7 days'`), "the row is untouched")
					return
				}
				require.Equal(t, 1, b.bizRows(t, "k"), "the message ran as new")
				require.EqualValues(t, 1, b.counter("idem_inbox_processed_total"))
				require.EqualValues(t, 1, b.counter("idem_inbox_expired_retry_total"), "counted as expired, once")
				require.Zero(t, b.counter("idem_inbox_duplicates_total"))
				require.Zero(t, b.counter("idem_inbox_failed_total"))
				require.Equal(t, 1, pgtest.Count(t, b.pool,
					`SELECT count(*) FROM inbox WHERE key = 'k' AND state = 'completed' AND error_code IS NULL
						AND fingerprint = $1 AND received_at > now() - interval '1 minute' AND expires_at > now() + interval '6 days'`,
					mustFP(`{"n":1}`)), "the expired row is replaced by a fresh one")

				// The fresh row is a live one: the redelivery is a duplicate.
				require.NoError(t, h(newMsg("k", `{"n":1}`)))
				require.Equal(t, 1, b.bizRows(t, "k"))
				require.EqualValues(t, 1, b.counter("idem_inbox_duplicates_total"))
				require.EqualValues(t, 1, b.counter("idem_inbox_expired_retry_total"))
			})
		}
	}
}

// A message older than the retention (MessageTime) that also meets its expired
// row is counted as expired once, not twice; under FailExpiredRetry its failure
// replaces the expired row.
func TestExpiredMessageAndRowCountOnce(t *testing.T) {
	t.Parallel()
	for _, p := range expiryPaths {
		for name, fail := range map[string]bool{"warn": false, "fail": true} {
			t.Run(p.name+"/"+name, func(t *testing.T) {
				t.Parallel()
				h, b := handlerFor(t, p, func(cfg *consumer.Config) {
					cfg.Retention = time.Hour
					cfg.FailExpiredRetry = fail
					cfg.MessageTime = func(*message.Message) (time.Time, bool) { return time.Now().Add(-2 * time.Hour), true }
				})
				_, err := b.pool.Exec(context.Background(), `INSERT INTO inbox (consumer, key, fingerprint, state, completed_at, expires_at)
					VALUES ('payments', 'k', $1, 'completed', now() - interval '2 hours', now() - interval '1 hour')`, mustFP(`{}`))
				require.NoError(t, err)
				require.NoError(t, h(newMsg("k", `{}`)))
				require.EqualValues(t, 1, b.counter("idem_inbox_expired_retry_total"))
				state, code := inboxState(t, b, "k")
				if fail {
					require.Equal(t, "failed", state)
					require.Equal(t, "expired_retry", code)
					require.Zero(t, b.bizRows(t, "k"))
					return
				}
				require.Equal(t, "completed", state)
				require.Equal(t, 1, b.bizRows(t, "k"))
			})
		}
	}
}
