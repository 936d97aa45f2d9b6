package consumer_test

import (
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
)

// Two copies of one key in the same batch: the second meets the first one's row in
// the same transaction and is a duplicate.
func TestGroupCommitDuplicateInsideOneBatch(t *testing.T) {
	t.Parallel()
	c, b := setup(t, consumer.GroupCommit, func(cfg *consumer.Config) {
		cfg.Batch.MaxWait = 300 * time.Millisecond // wait long enough to gather both copies
		cfg.Batch.Workers = 1
	})
	h := c.Middleware(b.bizHandler(nil))
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range 4 {
		wg.Go(func() {
			id := "dup-in-batch"
			if i%2 == 1 {
				id = "other"
			}
			_, errs[i] = h(newMsg(id, `{}`))
		})
	}
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}
	require.Equal(t, 1, b.bizRows(t, "dup-in-batch"))
	require.Equal(t, 1, b.bizRows(t, "other"))
	require.EqualValues(t, 2, b.counter("idem_inbox_duplicates_total"))
	require.EqualValues(t, 2, b.calls.Load())
}

// A failed message rolls back to its own savepoint; the rest of its batch commits.
// A panic fails that message alone and the worker survives.
func TestGroupCommitFailureIsolatedToItsSavepoint(t *testing.T) {
	t.Parallel()
	c, b := setup(t, consumer.GroupCommit, func(cfg *consumer.Config) {
		cfg.Batch.MaxWait = 300 * time.Millisecond
		cfg.Batch.Workers = 1
	})
	h := c.Middleware(b.bizHandler(func(m *message.Message) error {
		switch m.UUID {
		case "fails":
			return errors.New("transient")
		case "panics":
			panic("boom")
		case "permanent":
			return consumer.Permanent(errors.New("invalid"))
		}
		return nil
	}))
	ids := []string{"a", "fails", "b", "panics", "c", "permanent", "d"}
	var wg sync.WaitGroup
	errs := make([]error, len(ids))
	for i, id := range ids {
		wg.Go(func() { _, errs[i] = h(newMsg(id, `{}`)) })
	}
	wg.Wait()
	for i, id := range ids {
		switch id {
		case "fails", "panics":
			require.Error(t, errs[i], id)
			require.Equal(t, 0, b.bizRows(t, id), id)
		default:
			require.NoError(t, errs[i], id)
		}
	}
	for _, id := range []string{"a", "b", "c", "d"} {
		require.Equal(t, 1, b.bizRows(t, id), id)
	}
	require.Equal(t, 0, b.bizRows(t, "permanent"))
	require.Equal(t, 1, countInbox(t, b, "permanent", "failed"))
	require.Equal(t, 0, countInbox(t, b, "fails", "completed")+countInbox(t, b, "fails", "failed"))

	// The worker survived the panic.
	_, err := h(newMsg("after", `{}`))
	require.NoError(t, err)
}

func countInbox(t *testing.T, b *bundle, key, state string) int {
	var n int
	require.NoError(t, b.pool.QueryRow(t.Context(), `SELECT count(*) FROM inbox WHERE key = $1 AND state = $2`, key, state).Scan(&n))
	return n
}

func TestHandlerCannotCommitIdemsTransaction(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, mode consumer.Mode) {
		c, b := setup(t, mode)
		h := c.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			return nil, consumer.Tx(msg.Context()).Commit(msg.Context())
		})
		_, err := h(newMsg("x", `{}`))
		require.ErrorIs(t, err, consumer.ErrTxOwned)
		require.Equal(t, 0, countInbox(t, b, "x", "completed"))
	})
}
