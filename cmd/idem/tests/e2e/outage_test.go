package e2e

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/pgtest"
)

// TestPostgresOutage: Postgres goes away for two seconds in the middle of a stream
// (pgtest.Proxy cuts every connection of the services' pool and refuses new ones,
// as a restart or a failover does) while consumers commit and a Dispatcher sends.
// Deliveries during the outage are nacked with a stable code and redelivered, as a
// broker would; afterwards every message has committed exactly once, every effect
// is done, and the Dispatcher, whose claims and LISTEN connection were cut too,
// goes on by itself.
func TestPostgresOutage(t *testing.T) {
	t.Parallel()
	for _, mode := range []consumer.Mode{consumer.Transactional, consumer.GroupCommit} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			testPostgresOutage(t, mode)
		})
	}
}

func testPostgresOutage(t *testing.T, mode consumer.Mode) {
	ctx := context.Background()
	direct, schema := pgtest.Setup(t)
	_, err := direct.Exec(ctx, `CREATE TABLE biz (key text NOT NULL)`) // no unique key: a second commit shows
	require.NoError(t, err)
	proxy := pgtest.NewProxy(t, 0)
	pool := proxy.Pool(t, schema, pgtest.Options{MaxConns: 8})

	var mu sync.Mutex
	sends := map[string]int{}
	// A short lease: a claim or an outcome cut off by the outage comes back when it ends.
	d, err := effects.NewDispatcher(effects.Config{Pool: pool, Schema: schema, PollInterval: 100 * time.Millisecond, Lease: 2 * time.Second,
		Senders: map[string]effects.Sender{"mail": effects.SenderFunc(func(_ context.Context, e effects.Delivery) error {
			mu.Lock()
			sends[e.Key]++
			mu.Unlock()
			return nil
		})}})
	require.NoError(t, err)
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- d.Run(runCtx) }()

	c, err := consumer.New(consumer.Config{Name: "orders", Pool: pool, Schema: schema, Mode: mode,
		Batch: batchWait(mode, 5*time.Millisecond), LockTimeout: 5 * time.Second, BusyDelay: 5 * time.Millisecond})
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	h := c.Middleware(func(m *message.Message) ([]*message.Message, error) {
		ctx := m.Context()
		tx := consumer.Tx(ctx)
		if _, err := tx.Exec(ctx, `INSERT INTO biz (key) VALUES ($1)`, m.UUID); err != nil {
			return nil, err
		}
		_, err := effects.Enqueue(ctx, tx, effects.Effect{Kind: "mail", Key: "receipt:" + m.UUID, Payload: []byte(`{}`)})
		return nil, err
	})

	// The broker: eight workers deliver each message until it is acked.
	const n = 300
	queue := make(chan string, n)
	for i := range n {
		queue <- fmt.Sprintf("order-%03d", i)
	}
	close(queue)
	var acked atomic.Int64
	codes := map[string]int{}
	var codesMu sync.Mutex
	var wg sync.WaitGroup
	deadline := time.Now().Add(2 * time.Minute)
	for range 8 {
		wg.Go(func() {
			for key := range queue {
				for {
					_, err := h(message.NewMessage(key, []byte(`{}`)))
					if err == nil {
						acked.Add(1)
						break
					}
					codesMu.Lock()
					codes[inbox.Code(err)]++
					codesMu.Unlock()
					if consumer.IsPermanent(err) || time.Now().After(deadline) {
						t.Errorf("%s: %v", key, err)
						return
					}
					time.Sleep(20 * time.Millisecond) // the broker's redelivery delay
				}
			}
		})
	}
	pgtest.WaitFor(t, time.Minute, "a third of the messages acked", func() bool { return acked.Load() >= n/3 })
	proxy.Outage(2 * time.Second)
	wg.Wait()
	require.EqualValues(t, n, acked.Load())

	require.Equal(t, 0, pgtest.Count(t, direct, `SELECT count(*) FROM (SELECT key FROM biz GROUP BY key HAVING count(*) > 1) twice`),
		"no message committed twice")
	require.Equal(t, n, pgtest.Count(t, direct, `SELECT count(DISTINCT key) FROM biz`), "every message committed")
	pgtest.WaitFor(t, time.Minute, "the Dispatcher sends every effect after the outage", func() bool {
		return pgtest.Count(t, direct, `SELECT count(*) FROM effects WHERE state = 'done'`) == n
	})
	stop()
	require.NoError(t, <-done)

	mu.Lock()
	resent := 0
	for _, k := range sends {
		resent += k - 1
	}
	require.Len(t, sends, n)
	mu.Unlock()
	codesMu.Lock()
	defer codesMu.Unlock()
	require.Positive(t, codes["database_unavailable"], "nacks during the outage say so: %v", codes)
	for code := range codes {
		require.Contains(t, []string{"database_unavailable", "commit_unknown", "batch_aborted", "busy"}, code, "every nack is coded: %v", codes)
	}
	t.Logf("%d messages; nacks by code %v; %d connections refused; %d effects sent again (an attempt cut before its outcome was recorded)",
		n, codes, proxy.Refused(), resent)
}
