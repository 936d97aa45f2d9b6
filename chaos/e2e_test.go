package chaos_test

import (
	"context"
	"hash/fnv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/chaos"
	"github.com/idemkit/idem/internal/pgtest"
)

// e2eResult is one flavour's run.
type e2eResult struct {
	report chaos.Report
	stats  chaos.Stats
	pubDup int64
}

// runGoChannelChaos publishes n payments through a producer that sends 30% twice,
// into a GoChannel wrapped in a chaos.Subscriber (duplicates, redelivery after ack,
// reordering, delay), consumed by a Watermill router whose handler writes a ledger
// row and an email. One delivery in 20 fails transiently after its writes, and
// halfway through the consumer "restarts" (in-memory state is lost). The same seed
// drives every flavour.
func runGoChannelChaos(t *testing.T, f flavour, n int, seed int64) e2eResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
	defer cancel()
	pool, schema := setupPayments(t, 6)

	// Fail the first delivery of one key in 20, after its writes.
	var flakyMu sync.Mutex
	failed := map[string]bool{}
	flaky := func(msg *message.Message) bool {
		h := fnv.New32a()
		_, _ = h.Write([]byte(msg.UUID))
		if h.Sum32()%20 != 0 {
			return false
		}
		flakyMu.Lock()
		defer flakyMu.Unlock()
		if failed[msg.UUID] {
			return false
		}
		failed[msg.UUID] = true
		return true
	}
	st := newStack(f, pool, schema, flaky, nil)
	defer st.close()

	gc := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, watermill.NopLogger{})
	sub, err := chaos.NewSubscriber(gc, chaos.Config{
		Seed: seed, DuplicateProbability: 0.2, MaxCopies: 2,
		RedeliverProbability: 0.15, RedeliverDelay: 30 * time.Millisecond,
		ReorderWindow: 8, MaxDelay: 2 * time.Millisecond,
	})
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddConsumerHandler(consumerName, "payments", sub, message.NoPublishHandlerFunc(func(msg *message.Message) error {
		_, err := st.handler(msg)
		return err
	}))
	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(ctx) }()
	<-router.Running()

	pub, err := chaos.NewPublisher(gc, chaos.PublisherConfig{Seed: seed, DuplicateProbability: 0.3})
	require.NoError(t, err)
	keys := paymentKeys(n)
	for i, k := range keys {
		if i == n/2 {
			// Let the first half land, then restart: memory is gone, the broker's
			// redeliveries of acked messages keep coming.
			pgtest.WaitFor(t, 20*time.Second, "half of the messages acked upstream", func() bool { return sub.Stats().UpstreamAcked >= int64(n/2) })
			st.restart()
		}
		require.NoError(t, pub.Publish("payments", message.NewMessage(k, paymentPayload(k))))
	}

	// Wait until every upstream message is acked and nothing injected is left:
	// deliveries all answered and no new ones for a while.
	var last chaos.Stats
	quietSince := time.Now()
	for {
		s := sub.Stats()
		if s != last {
			last, quietSince = s, time.Now()
		}
		if s.UpstreamAcked >= int64(n)+pub.Duplicates() && s.Delivered == s.Acked+s.Nacked && time.Since(quietSince) > 300*time.Millisecond {
			break
		}
		require.NoError(t, ctx.Err(), "run did not finish: %+v", s)
		time.Sleep(10 * time.Millisecond)
	}
	require.NoError(t, router.Close())
	require.NoError(t, <-routerDone)
	require.NoError(t, sub.Close())
	require.NoError(t, pub.Close())

	// Carry out the effects (idem only) and audit.
	if f != peerDeduplicator {
		_, err := sendEmails(ctx, pool, time.Second)
		require.NoError(t, err)
	}
	stats := sub.Stats()
	a, err := chaos.NewAuditor(chaos.AuditorConfig{Pool: pool, Schema: schema, SettleQuiet: 200 * time.Millisecond})
	require.NoError(t, err)
	suppressed := st.counter("idem_inbox_duplicates_total")
	if f == peerDeduplicator {
		suppressed = -1 // the Deduplicator counts nothing
	}
	q := auditQuery(f, keys, stats.Delivered, suppressed)
	q = withSends(q, pool)
	rep, err := a.Settled(ctx, q)
	require.NoError(t, err)
	return e2eResult{report: rep, stats: stats, pubDup: pub.Duplicates()}
}

// TestGoChannelChaosEndToEnd runs the chaos run through idem in both commit modes
// and through Watermill's in-memory Deduplicator, and prints the reports side by
// side. idem must commit every payment once, lose nothing, and suppress at least
// every injected duplicate; the peer's figures are printed, not asserted beyond
// showing that the harness can catch a loss or a double commit.
func TestGoChannelChaosEndToEnd(t *testing.T) {
	const n, seed = 300, 20261121
	flavours := []flavour{idemTransactional, idemGroupCommit, peerDeduplicator}
	results := make([]e2eResult, len(flavours))
	var wg sync.WaitGroup
	for i, f := range flavours {
		t.Run(string(f), func(t *testing.T) {
			wg.Add(1)
			defer wg.Done()
			results[i] = runGoChannelChaos(t, f, n, seed)
			r := results[i]
			t.Logf("chaos: %+v, producer duplicates %d", r.stats, r.pubDup)
			if f == peerDeduplicator {
				return
			}
			rep := r.report
			require.NoError(t, rep.Err(), "\n%s", rep)
			require.Equal(t, n, rep.CommittedOnce)
			require.Zero(t, rep.CommittedTwice)
			require.Zero(t, rep.Lost)
			require.Equal(t, n, rep.EffectsDone)
			require.Equal(t, n, rep.SendsOnce)
			injected := r.stats.Duplicates + r.stats.Redeliveries + r.pubDup
			require.Positive(t, injected)
			require.GreaterOrEqual(t, rep.DuplicatesSuppressed, injected)
			// Every acked delivery beyond the one that committed was suppressed.
			require.Equal(t, r.stats.Acked-int64(n), rep.DuplicatesSuppressed)
		})
	}
	if t.Failed() {
		return
	}
	var reps []chaos.Report
	for i, f := range flavours {
		r := results[i].report
		r.Consumer = string(f) // the column's title
		reps = append(reps, r)
	}
	t.Logf("GoChannel chaos run, N=%d, seed %d:\n%s", n, seed, reps[0].Beside(reps[1:]...))
	peer := results[2].report
	require.False(t, peer.OK(), "the peer came through a run with transient failures and a restart unharmed; the harness is not biting:\n%s", peer)
}
