package consumer_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/migrate"
)

// On Citus, a worker restarted with pg_ctl restart -m immediate while a consumer
// commits payments for tenants of both workers: while it is down the other
// worker's tenants keep committing, and its own tenants commit again once it is
// back. Each tenant's messages are delivered in turn, each again until it is
// acknowledged: every acknowledged payment is in the ledger once (lost 0,
// committed twice 0).
func TestCitusWorkerRestartedMidStream(t *testing.T) {
	ctx := context.Background()
	pool, schema, ctl := pgtest.CrashableCitus(t, pgtest.Options{MaxConns: 8})
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: schema, Citus: true})
	require.NoError(t, err)
	_, err = m.Up(ctx)
	require.NoError(t, err)
	// No unique key on the payment: a payment committed twice would be two rows.
	_, err = pool.Exec(ctx, `CREATE TABLE ledger (tenant text NOT NULL, key text NOT NULL, amount int NOT NULL)`)
	require.NoError(t, err)
	pgtest.Distribute(t, pool, schema, "ledger")

	byWorker := map[int][]string{}
	for i := 0; len(byWorker[1]) < 2 || len(byWorker[2]) < 2; i++ {
		tenant := fmt.Sprint("t", i)
		if w := pgtest.CitusWorkerOf(t, pool, pgx.Identifier{schema, "ledger"}.Sanitize(), tenant); len(byWorker[w]) < 2 {
			byWorker[w] = append(byWorker[w], tenant)
		}
	}

	c, err := consumer.New(consumer.Config{Name: "payments", Pool: pool, Schema: schema, Mode: consumer.Transactional,
		Tenant: consumer.MetadataKey("tenant"), LockTimeout: 5 * time.Second, Registerer: prometheus.NewRegistry()})
	require.NoError(t, err)
	defer func() { require.NoError(t, c.Close()) }()
	h := c.Middleware(func(m *message.Message) ([]*message.Message, error) {
		_, err := consumer.Tx(m.Context()).Exec(m.Context(), `INSERT INTO ledger (tenant, key, amount) VALUES ($1, $2, 1)`,
			m.Metadata.Get("tenant"), m.UUID)
		return nil, err
	})

	acked := map[string]*atomic.Int64{}
	for _, ts := range byWorker {
		for _, tenant := range ts {
			acked[tenant] = &atomic.Int64{}
		}
	}
	stop := make(chan struct{})
	var producers sync.WaitGroup
	for tenant, n := range acked {
		producers.Go(func() {
			for i := 0; ; i++ {
				msg := citusMsg(tenant, fmt.Sprint(i))
				for {
					select {
					case <-stop:
						return
					default:
					}
					mctx, cancel := context.WithTimeout(ctx, 10*time.Second)
					m := msg.Copy()
					m.SetContext(mctx)
					_, err := h(m)
					cancel()
					if err == nil {
						n.Add(1)
						break
					}
					time.Sleep(50 * time.Millisecond) // redelivered after a nack
				}
			}
		})
	}
	sum := func(w int) int64 {
		var s int64
		for _, tenant := range byWorker[w] {
			s += acked[tenant].Load()
		}
		return s
	}
	pgtest.WaitFor(t, 30*time.Second, "both workers' tenants committing", func() bool { return sum(1) >= 10 && sum(2) >= 10 })

	ctl.CrashWorker(1)
	down1, before2 := sum(1), sum(2)
	pgtest.WaitFor(t, 30*time.Second, "worker 2's tenants committing while worker 1 is down", func() bool { return sum(2) >= before2+20 })
	require.LessOrEqual(t, sum(1), down1+int64(len(byWorker[1])), "worker 1's tenants committed while it was down (at most one in flight each)")
	ctl.StartWorker(1)
	back1 := sum(1)
	pgtest.WaitFor(t, 60*time.Second, "worker 1's tenants committing again", func() bool { return sum(1) >= back1+20 })
	close(stop)
	producers.Wait()

	for tenant, n := range acked {
		var rows, keys int64
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT key) FROM ledger WHERE tenant = $1`, tenant).Scan(&rows, &keys))
		require.Equal(t, keys, rows, "payments of %s committed twice", tenant)
		// The last message may have committed without its acknowledgement (the
		// stop came while it was redelivered): at most one more row than acks.
		require.GreaterOrEqual(t, keys, n.Load(), "payments of %s lost", tenant)
		require.LessOrEqual(t, keys, n.Load()+1, "payments of %s", tenant)
		require.Equal(t, int(keys), pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE consumer = 'payments' AND tenant = $1 AND state = 'completed'`, tenant))
	}
}
