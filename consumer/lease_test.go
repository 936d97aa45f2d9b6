package consumer_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/pgtest"
)

func TestLeaseMode(t *testing.T) {
	t.Parallel()
	c, b := setup(t, consumer.Lease, func(cfg *consumer.Config) { cfg.Lease = 300 * time.Millisecond })
	var n atomic.Int64
	h := c.Middleware(b.bizHandler(func(m *message.Message) error {
		switch string(m.Payload) {
		case "flaky":
			if n.Add(1) == 1 {
				return errors.New("timeout")
			}
		case "bad":
			return consumer.Permanent(errors.New("declined"))
		}
		return nil
	}))
	for range 5 {
		_, err := h(newMsg("l-1", "ok"))
		require.NoError(t, err)
	}
	require.Equal(t, 1, b.bizRows(t, "l-1"))

	// A transient failure releases the lease, so the redelivery runs at once.
	_, err := h(newMsg("l-2", "flaky"))
	require.Error(t, err)
	_, err = h(newMsg("l-2", "flaky"))
	require.NoError(t, err)
	require.Equal(t, 1, b.bizRows(t, "l-2"))

	_, err = h(newMsg("l-3", "bad"))
	require.NoError(t, err)
	require.Equal(t, 0, b.bizRows(t, "l-3"))
	require.Equal(t, 1, pgtest.Count(t, b.pool, `SELECT count(*) FROM inbox WHERE key = 'l-3' AND state = 'failed'`))

	_, err = h(newMsg("l-1", "changed"))
	require.ErrorIs(t, err, consumer.ErrFingerprintMismatch)
}

// A delivery that finds a fresh lease nacks; once the lease runs out (the holder
// crashed), the next delivery takes the key over with a newer fence, and the old
// holder can no longer complete it.
func TestLeaseTakeoverAfterCrash(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c, b := setup(t, consumer.Lease, func(cfg *consumer.Config) { cfg.Lease = 300 * time.Millisecond })
	store, err := inboxdb.NewStore(b.schema)
	require.NoError(t, err)
	claim := inboxdb.Claim{ID: inboxdb.ID{Consumer: "payments", Key: "l-crash"}, Fingerprint: mustFP("x")}
	res, err := store.Lease(ctx, b.pool, claim, 300*time.Millisecond) // the holder that "crashes"
	require.NoError(t, err)
	require.True(t, res.Claimed)

	h := c.Middleware(b.bizHandler(nil))
	_, err = h(newMsg("l-crash", "x"))
	require.ErrorIs(t, err, consumer.ErrBusy, "a fresh lease makes a duplicate nack")

	time.Sleep(400 * time.Millisecond)
	_, err = h(newMsg("l-crash", "x"))
	require.NoError(t, err)
	require.Equal(t, 1, b.bizRows(t, "l-crash"))

	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	require.ErrorIs(t, store.CompleteLeaseTx(ctx, tx, claim.ID, res.Fence, 0), inbox.ErrLeaseLost)
}
