package consumer

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
)

// Two batches that hold the same keys in opposite orders. Each handler sleeps after
// its claim, so without sorting batch 1 holds a and wants b while batch 2 holds b
// and wants a: a deadlock, which Postgres breaks by failing one batch (40P01). With
// keys claimed in sorted order, batch 2 waits for batch 1 and then sees duplicates.
func TestGroupBatchesClaimKeysInSortedOrder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.Setup(t)
	_, err := pool.Exec(ctx, `CREATE TABLE biz (key text NOT NULL)`)
	require.NoError(t, err)
	c, err := New(Config{Name: "payments", Pool: pool, Schema: schema, Mode: GroupCommit, LockTimeout: 10 * time.Second})
	require.NoError(t, err)
	g := &groupCommitter{c: c.parts.Part(0)} // no workers: the test forms the batches itself
	h := func(msg *message.Message) ([]*message.Message, error) {
		if _, err := Tx(msg.Context()).Exec(msg.Context(), `INSERT INTO biz VALUES ($1)`, msg.UUID); err != nil {
			return nil, err
		}
		time.Sleep(300 * time.Millisecond)
		return nil, nil
	}
	batch := func(ids ...string) []*groupReq {
		var out []*groupReq
		for _, id := range ids {
			req, err := c.parts.Part(0).prepare(message.NewMessage(id, []byte(`{}`)))
			require.NoError(t, err)
			out = append(out, &groupReq{req: req, h: h, done: make(chan outcome, 1)})
		}
		return out
	}
	b1, b2 := batch("a", "b"), batch("b", "a")
	var wg sync.WaitGroup
	wg.Go(func() { g.run(b1) })
	time.Sleep(50 * time.Millisecond)
	wg.Go(func() { g.run(b2) })
	wg.Wait()

	kinds := map[outcomeKind]int{}
	for _, r := range append(b1, b2...) {
		o := <-r.done
		require.NoError(t, func() error {
			if o.kind == outTransient || o.kind == outBusy {
				return o.err
			}
			return nil
		}(), "no batch may fail on a deadlock")
		kinds[o.kind]++
	}
	require.Equal(t, 2, kinds[outCommitted])
	require.Equal(t, 2, kinds[outDuplicate])
	require.Equal(t, 2, pgtest.Count(t, pool, `SELECT count(*) FROM biz`))
}

// A message racing Close may start the group-commit workers, but
// Close still stops them, and no message after Close starts new ones.
func TestCloseStopsWorkersARacingMessageStarted(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.Setup(t)
	for range 20 {
		c, err := New(Config{Name: "payments", Pool: pool, Schema: schema, Mode: GroupCommit})
		require.NoError(t, err)
		h := c.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
		done := make(chan struct{})
		go func() {
			defer close(done)
			_, _ = h(message.NewMessage("race", []byte(`{}`)))
		}()
		require.NoError(t, c.Close())
		<-done
		_, err = h(message.NewMessage("after", []byte(`{}`)))
		require.ErrorIs(t, err, ErrClosed)

		e := c.parts.Part(0)
		e.mu.Lock()
		g := e.group
		e.mu.Unlock()
		if g == nil {
			continue // the racing message came after Close: no worker ever started
		}
		select {
		case <-g.stop:
		default:
			t.Fatal("Close left the workers of a racing message running")
		}
		stopped := make(chan struct{})
		go func() { g.wg.Wait(); close(stopped) }()
		select {
		case <-stopped:
		case <-time.After(30 * time.Second):
			t.Fatal("the workers did not stop")
		}
	}
}
