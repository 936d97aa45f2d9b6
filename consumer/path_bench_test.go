package consumer

import (
	"context"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/cpustat"
	"github.com/idemkit/idem/internal/pgtest"
)

// BenchmarkPath is idem's own path for a delivery, without Watermill's router or a
// broker: partitions goroutines each hand their messages, one at a time, to the
// handler that HandleBatch (batch) or the GroupCommit Middleware (group) returns,
// as a router's handler goroutines do. Each message writes one business row
// (one INSERT … unnest for the batch, one INSERT per message in group mode) and
// enqueues one effect, as idem bench's handlers do; a tenth of the messages are
// delivered twice. It reports the CPU time per delivery of this process and of
// the pool's Postgres backends, and allocations per delivery: idem's and pgx's
// own, the messages being made before the clock starts.
//
//	go test -run '^$' -bench Path -benchtime 20000x ./consumer
func BenchmarkPath(b *testing.B) {
	b.Run("batch", func(b *testing.B) { benchPath(b, true, 256) })
	b.Run("group", func(b *testing.B) { benchPath(b, false, 64) })
}

func benchPath(b *testing.B, batch bool, partitions int) {
	pool, schema := pgtest.Setup(b, pgtest.Options{MaxConns: 8})
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE biz (id bigserial PRIMARY KEY, key text NOT NULL, payload bytea)`)
	require.NoError(b, err)
	cfg := Config{Name: "bench", Pool: pool, Schema: schema}
	if batch {
		cfg.Batch.MaxBatch = 256
	} else {
		cfg.Mode = GroupCommit
	}
	c, err := New(cfg)
	require.NoError(b, err)
	b.Cleanup(func() { _ = c.Close() })
	var handle func(*message.Message) error
	if batch {
		handle = c.HandleBatch(func(ctx context.Context, tx pgx.Tx, msgs []*message.Message) error {
			keys := make([]string, len(msgs))
			payloads := make([][]byte, len(msgs))
			for i, m := range msgs {
				keys[i], payloads[i] = m.UUID, m.Payload
				if _, err := effects.Enqueue(m.Context(), tx, effects.Effect{Kind: "bench", Key: "fx:" + m.UUID, Payload: m.Payload}); err != nil {
					return ForMessage(m, err)
				}
			}
			_, err := tx.Exec(ctx, `INSERT INTO biz (key, payload) SELECT * FROM unnest($1::text[], $2::bytea[])`, keys, payloads)
			return err
		})
	} else {
		h := c.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			tx := Tx(ctx)
			if _, err := tx.Exec(ctx, `INSERT INTO biz (key, payload) VALUES ($1, $2)`, msg.UUID, msg.Payload); err != nil {
				return nil, err
			}
			_, err := effects.Enqueue(ctx, tx, effects.Effect{Kind: "bench", Key: "fx:" + msg.UUID, Payload: msg.Payload})
			return nil, err
		})
		handle = func(m *message.Message) error { _, err := h(m); return err }
	}
	payload := make([]byte, 128)
	makeMsgs := func(n int) [][]*message.Message {
		parts := make([][]*message.Message, partitions)
		for i := range n {
			id := NewUUID()
			p := i % partitions
			parts[p] = append(parts[p], message.NewMessage(id, payload))
			if i%10 == 9 {
				parts[p] = append(parts[p], message.NewMessage(id, payload))
			}
		}
		return parts
	}
	run := func(parts [][]*message.Message) int {
		var wg sync.WaitGroup
		var mu sync.Mutex
		var firstErr error
		n := 0
		for _, msgs := range parts {
			n += len(msgs)
			wg.Go(func() {
				for _, m := range msgs {
					if err := handle(m); err != nil {
						mu.Lock()
						firstErr = err
						mu.Unlock()
					}
				}
			})
		}
		wg.Wait()
		require.NoError(b, firstErr)
		return n
	}
	run(makeMsgs(2 * partitions)) // start the workers, open the connections, prepare the statements
	parts := makeMsgs(b.N)
	app := "idem-test:" + schema
	before := cpustat.Take(ctx, pool, app)
	b.ResetTimer()
	n := run(parts)
	b.StopTimer()
	d := cpustat.Take(ctx, pool, app).Since(before)
	b.ReportMetric(cpustat.PerOp(d.Self, n), "go-µs/msg")
	if d.BackendsSeen {
		b.ReportMetric(cpustat.PerOp(d.Backends, n), "pg-µs/msg")
	}
	b.ReportMetric(float64(d.Mallocs)/float64(n), "allocs/msg")
	b.ReportMetric(float64(d.AllocBytes)/float64(n), "B/msg")
	b.ReportMetric(float64(n)/b.Elapsed().Seconds(), "msgs/s")
}
