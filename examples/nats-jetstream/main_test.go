package main

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/adapters/nats"
	"github.com/idemkit/idem/internal/pgtest"
)

// TestSmoke runs the example against an embedded JetStream server and the test
// Postgres: 20 orders, 4 of them published twice, make 20 ledger rows and 20 email
// effects.
func TestSmoke(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 2, NoMigrate: true})
	srv, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: t.TempDir(), NoLog: true, NoSigs: true})
	require.NoError(t, err)
	go srv.Start()
	require.True(t, srv.ReadyForConnections(10*time.Second))
	t.Cleanup(func() { srv.Shutdown(); srv.WaitForShutdown() })

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, Config{DatabaseURL: pgtest.URL() + "&pool_max_conns=3", NATSURL: srv.ClientURL(),
			Durable: "orders-ledger", Schema: schema, Publish: 20, Logger: slog.New(slog.DiscardHandler)})
	}()
	var early error
	ended := false
	pgtest.WaitFor(t, 30*time.Second, "the example to run", func() bool {
		select {
		case early = <-done:
			ended = true
			return true
		default:
		}
		var n int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM effects WHERE kind = 'email' AND key LIKE 'order-confirmation:%'`).Scan(&n)
		return err == nil && n == 20 // the tables appear once run has migrated
	})
	require.False(t, ended, "run ended early: %v", early)
	// Every delivery, duplicates included, handled and acked: the broker has
	// nothing left for the consumer.
	pgtest.WaitFor(t, 30*time.Second, "the consumer to drain the stream", func() bool {
		backlog, err := pending(ctx, srv.ClientURL(), "orders-ledger")
		return err == nil && backlog == 0
	})
	cancel()
	require.NoError(t, <-done)
	require.Equal(t, 20, pgtest.Count(t, pool, `SELECT count(*) FROM order_ledger`))
	require.Equal(t, 20, pgtest.Count(t, pool, `SELECT count(DISTINCT order_id) FROM order_ledger`))
	require.Equal(t, 20, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE consumer = 'orders-ledger' AND state = 'completed'`))
}

// pending is what the durable has not acked yet: messages not delivered and
// deliveries waiting for their ack.
func pending(ctx context.Context, url, durable string) (uint64, error) {
	nc, err := natsgo.Connect(url)
	if err != nil {
		return 0, err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return 0, err
	}
	c, err := js.Consumer(ctx, nats.Topology{}.StreamOf(Topic), durable)
	if err != nil {
		return 0, err
	}
	info, err := c.Info(ctx)
	if err != nil {
		return 0, err
	}
	return info.NumPending + uint64(info.NumAckPending), nil
}
