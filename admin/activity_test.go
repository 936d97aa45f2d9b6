package admin_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/admin"
)

// TestActivity seeds rows at known minutes (relative to the database's current
// minute M) and reads them back per minute: the inbox's completed and failed keys,
// the effects sent and dead, and the backlog with its oldest age at each minute's
// end, rebuilt from when each effect was enqueued and settled.
func TestActivity(t *testing.T) {
	a, b := setup(t)
	ctx := context.Background()
	b.exec(t, `INSERT INTO inbox (consumer, key, fingerprint, state, completed_at, expires_at) VALUES
		('c', 'k1', '\x00', 'completed', date_trunc('minute', now()) - interval '10 minutes' + interval '30 seconds', now() + interval '1 day'),
		('c', 'k2', '\x00', 'completed', date_trunc('minute', now()) - interval '10 minutes' + interval '31 seconds', now() + interval '1 day'),
		('c', 'k3', '\x00', 'completed', date_trunc('minute', now()) - interval '10 minutes' + interval '59 seconds', now() + interval '1 day'),
		('c', 'f1', '\x00', 'failed', date_trunc('minute', now()) - interval '10 minutes' + interval '1 second', now() + interval '1 day'),
		('d', 'f2', '\x00', 'failed', date_trunc('minute', now()) - interval '10 minutes', now() + interval '1 day'),
		('c', 'old', '\x00', 'completed', date_trunc('minute', now()) - interval '120 minutes', now() + interval '1 day'),
		('c', 'p', '\x00', 'processing', NULL, now() + interval '1 day')`)
	b.exec(t, `INSERT INTO effects (kind, key, fingerprint, state, created_at, done_at, dead_at) VALUES
		('mail', 'pending', '\x00', 'pending', date_trunc('minute', now()) - interval '30 minutes' + interval '30 seconds', NULL, NULL),
		('mail', 'dead', '\x00', 'dead', date_trunc('minute', now()) - interval '20 minutes' + interval '30 seconds', NULL, date_trunc('minute', now()) - interval '5 minutes' + interval '30 seconds'),
		('mail', 'sent1', '\x00', 'done', date_trunc('minute', now()) - interval '7 minutes' + interval '30 seconds', date_trunc('minute', now()) - interval '5 minutes' + interval '30 seconds', NULL),
		('sms', 'sent2', '\x00', 'done', date_trunc('minute', now()) - interval '7 minutes' + interval '30 seconds', date_trunc('minute', now()) - interval '5 minutes' + interval '40 seconds', NULL),
		('sms', 'discarded', '\x00', 'discarded', date_trunc('minute', now()) - interval '3 days', date_trunc('minute', now()) - interval '2 minutes', date_trunc('minute', now()) - interval '3 minutes' + interval '30 seconds'),
		('sms', 'ancient', '\x00', 'done', date_trunc('minute', now()) - interval '3 days', date_trunc('minute', now()) - interval '2 days', NULL)`)

	act, err := a.Activity(ctx, time.Hour)
	require.NoError(t, err)
	require.Len(t, act.Minutes, 60)
	n := len(act.Minutes)
	m := func(k int) minute { return act.Minutes[n-1-k] }
	require.Equal(t, act.Now.Truncate(time.Minute).UTC(), m(0).At.UTC(), "the last minute is the current one")
	require.Equal(t, time.Minute, m(0).At.Sub(m(1).At))

	require.Equal(t, minute{At: m(10).At, Completed: 3, Failed: 2, Pending: 3, OldestPendingSeconds: 3*24*3600 - 9*60}, m(10),
		"three keys completed and two failed in minute M-10; the pending, the dead and the discarded effects were waiting at its end")
	require.Equal(t, minute{At: m(5).At, Sent: 2, Dead: 1, Pending: 2, OldestPendingSeconds: 3*24*3600 - 4*60}, m(5),
		"two sent and one dead in minute M-5; at its end the pending effect and the discarded one (dead at M-3) wait")
	var completed, failed, sent, dead int64
	for _, x := range act.Minutes {
		completed, failed, sent, dead = completed+x.Completed, failed+x.Failed, sent+x.Sent, dead+x.Dead
	}
	require.Equal(t, []int64{3, 2, 2, 1}, []int64{completed, failed, sent, dead}, "the key of two hours ago and the effect of two days ago are out of the hour")

	// The backlog at each minute's end: the discarded effect from 3 days ago until
	// it died at M-3 (it is the oldest), the pending one from M-30, the dead one
	// from M-20 to M-5, the two sent from M-7 to M-5.
	want := map[int]int64{45: 1, 31: 1, 30: 2, 21: 2, 20: 3, 8: 3, 7: 5, 6: 5, 5: 2, 4: 2, 3: 1, 0: 1}
	for k, p := range want {
		require.Equal(t, p, m(k).Pending, "backlog at the end of minute M-%d", k)
	}
	require.InDelta(t, 3*24*3600-44*60, m(45).OldestPendingSeconds, 0.001, "the discarded effect, enqueued 3 days ago, at the end of M-45")
	require.InDelta(t, act.Now.Sub(m(30).At.Add(30*time.Second)).Seconds(), m(0).OldestPendingSeconds, 0.001, "now, the pending effect of M-30 is the oldest, measured at now")

	day, err := a.Activity(ctx, 24*time.Hour)
	require.NoError(t, err)
	require.Len(t, day.Minutes, 1440)
	require.Equal(t, int64(1), day.Minutes[1440-1-120].Completed, "the key of two hours ago is in the day")

	for _, w := range []time.Duration{0, 25 * time.Hour} {
		_, err = a.Activity(ctx, w)
		require.ErrorIs(t, err, admin.ErrBadFilter)
	}
}

// minute is the type of Activity.Minutes' elements.
type minute = struct {
	At                   time.Time `json:"at"`
	Completed            int64     `json:"completed"`
	Failed               int64     `json:"failed"`
	Sent                 int64     `json:"sent"`
	Dead                 int64     `json:"dead"`
	Pending              int64     `json:"pending"`
	OldestPendingSeconds float64   `json:"oldest_pending_seconds"`
}
