package main

import (
	"context"
	"log/slog"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/internal/pgtest"
)

// TestSmoke runs the example against an in-process Kafka-protocol broker (kfake)
// and the test Postgres: 20 orders, 4 of them published twice, make 20 ledger rows
// and 20 email effects.
func TestSmoke(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 2, NoMigrate: true})
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(3, Topic))
	require.NoError(t, err)
	t.Cleanup(cluster.Close)

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, Config{DatabaseURL: pgtest.URL() + "&pool_max_conns=3", Brokers: cluster.ListenAddrs(),
			Group: "orders-ledger", Schema: schema, Publish: 20, Logger: slog.New(slog.DiscardHandler)})
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
	pgtest.WaitFor(t, 30*time.Second, "the group to drain the topic", func() bool {
		client := &kafkago.Client{Addr: kafkago.TCP(cluster.ListenAddrs()...), Timeout: 5 * time.Second}
		lag, err := kafka.Lag(ctx, client, "orders-ledger", Topic)
		return err == nil && lag.Total == 0
	})
	cancel()
	require.NoError(t, <-done)
	require.Equal(t, 20, pgtest.Count(t, pool, `SELECT count(*) FROM order_ledger`))
	require.Equal(t, 20, pgtest.Count(t, pool, `SELECT count(DISTINCT order_id) FROM order_ledger`))
	require.Equal(t, 20, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE consumer = 'orders-ledger' AND state = 'completed'`))
}
