package chaos_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/chaos"
	"github.com/idemkit/idem/consumer"
)

// The functions below are the guide's chaos snippets (docs/chaos.md): compiled
// with the tests, not run.

// docDuplicatingPublisher wraps a publisher that sends some messages twice.
func docDuplicatingPublisher(brokerPublisher message.Publisher) *chaos.Publisher {
	pub, _ := chaos.NewPublisher(brokerPublisher, chaos.PublisherConfig{Seed: 42, DuplicateProbability: 0.3})
	return pub
}

// docCrashMiddlewareOrder adds the crash middleware outside idem's.
func docCrashMiddlewareOrder(router *message.Router, idemConsumer *consumer.Consumer) {
	router.AddMiddleware(chaos.CrashMiddleware, idemConsumer.Middleware) // order matters: outside first
}

// docAudit audits a run until it settles, then adds what only the process
// counted: its deliveries and the duplicates it suppressed.
func docAudit(ctx context.Context, t *testing.T, pool *pgxpool.Pool, ids []string, sub *chaos.Subscriber,
	smtpReceiver interface {
		CountsByMessageID(context.Context) (map[string]int, error)
	}, idemDuplicatesCounter func() int64,
) {
	a, _ := chaos.NewAuditor(chaos.AuditorConfig{Pool: pool, Schema: "idem"})
	rep, err := a.Settled(ctx, chaos.AuditQuery{
		Consumer:     "payments",
		ExpectedKeys: ids,                                                  // what was published
		BusinessSQL:  `SELECT payment_id, count(*) FROM ledger GROUP BY 1`, // the ground truth
		EffectKind:   "email",
		EffectKey:    func(k string) string { return "receipt:" + k },
		Sends:        smtpReceiver.CountsByMessageID, // optional: what the world received
	})
	require.NoError(t, err)
	rep.Deliveries = sub.Stats().Delivered             // counted once the run has settled
	rep.DuplicatesSuppressed = idemDuplicatesCounter() // idem_inbox_duplicates_total, or -1
	fmt.Print(rep)                                     // an aligned table
	require.True(t, rep.OK(), "%v", rep.Err())
}

var _ = []any{docDuplicatingPublisher, docCrashMiddlewareOrder, docAudit}
