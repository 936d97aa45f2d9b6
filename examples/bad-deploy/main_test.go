package main

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/idemkit/idem/internal/pgtest"
)

// TestBadDeploy runs the walkthrough end to end on the Kafka broker of
// KAFKA_BROKERS (the real one CI starts), else on an in-process Kafka-protocol
// broker (kfake), and the test Postgres: v1 fails every third order, the group is
// released, the poison topic is requeued and the same messages published again,
// and every order is committed exactly once.
func TestBadDeploy(t *testing.T) {
	t.Parallel()
	_, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 2, NoMigrate: true})
	brokers := strings.Split(os.Getenv("KAFKA_BROKERS"), ",")
	if brokers[0] == "" {
		cluster, err := kfake.NewCluster(kfake.NumBrokers(1))
		require.NoError(t, err)
		t.Cleanup(cluster.Close)
		brokers = cluster.ListenAddrs()
		t.Log("KAFKA_BROKERS is not set: on kfake, an in-process Kafka-protocol broker")
	}
	var out strings.Builder
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	res, err := Run(ctx, Config{DatabaseURL: pgtest.URL(), Brokers: brokers, Schema: schema, Orders: 30, Out: &out})
	require.NoError(t, err, out.String())
	t.Log("\n" + out.String())
	require.Equal(t, 10, res.Failed, "every third order failed on v1")
	require.Equal(t, 10, res.Released)
	require.Equal(t, 30, res.LedgerRows, "one ledger row per order")
	require.Equal(t, 30, res.DistinctOrders)
	require.Zero(t, res.FailedKeys)
	require.Contains(t, out.String(), "its key is still failed, the redelivery replayed the recorded failure")
	require.Contains(t, out.String(), "Each order committed exactly once.")
}
