package main

import (
	"context"
	"fmt"
	"log/slog"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

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
		backlog, err := lag(ctx, cluster.ListenAddrs(), "orders-ledger")
		return err == nil && backlog == 0
	})
	cancel()
	require.NoError(t, <-done)
	require.Equal(t, 20, pgtest.Count(t, pool, `SELECT count(*) FROM order_ledger`))
	require.Equal(t, 20, pgtest.Count(t, pool, `SELECT count(DISTINCT order_id) FROM order_ledger`))
	require.Equal(t, 20, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE consumer = 'orders-ledger' AND state = 'completed'`))
}

// lag is how many records of Topic the group has not committed yet, over all
// partitions: the end offsets less the committed ones.
func lag(ctx context.Context, brokers []string, group string) (int64, error) {
	client := &kafkago.Client{Addr: kafkago.TCP(brokers...), Timeout: 5 * time.Second}
	meta, err := client.Metadata(ctx, &kafkago.MetadataRequest{Topics: []string{Topic}})
	if err != nil {
		return 0, err
	}
	if len(meta.Topics) != 1 || meta.Topics[0].Error != nil {
		return 0, fmt.Errorf("metadata of %s: %v", Topic, meta.Topics)
	}
	var parts []int
	var reqs []kafkago.OffsetRequest
	for _, p := range meta.Topics[0].Partitions {
		parts = append(parts, p.ID)
		reqs = append(reqs, kafkago.LastOffsetOf(p.ID))
	}
	ends, err := client.ListOffsets(ctx, &kafkago.ListOffsetsRequest{Topics: map[string][]kafkago.OffsetRequest{Topic: reqs}})
	if err != nil {
		return 0, err
	}
	committed, err := client.OffsetFetch(ctx, &kafkago.OffsetFetchRequest{GroupID: group, Topics: map[string][]int{Topic: parts}})
	if err != nil {
		return 0, err
	}
	done := map[int]int64{}
	for _, p := range committed.Topics[Topic] {
		if p.Error != nil {
			return 0, p.Error
		}
		done[p.Partition] = max(p.CommittedOffset, 0)
	}
	var total int64
	for _, p := range ends.Topics[Topic] {
		if p.Error != nil {
			return 0, p.Error
		}
		total += max(p.LastOffset-done[p.Partition], 0)
	}
	return total, nil
}
