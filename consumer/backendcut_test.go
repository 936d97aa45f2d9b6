package consumer_test

// Backend cuts of a set-based batch: the batch's connection is
// terminated from outside (pg_terminate_backend, as a failover or a network cut
// would) while the batch waits in its claim statement, while a handler runs, while
// it waits in its effects statement, or in its COMMIT. Every answer agrees with the
// inbox, and the redeliveries commit each message once.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/pgtest"
)

// cutKeys are the messages of each batch; cutVictim is the one the cut is aimed at.
var cutKeys = []string{"cut-1", "cut-2", "cut-3", "cut-4", "cut-5", "cut-6"}

const cutVictim = "cut-4"

func TestSetBasedBatchBackendCut(t *testing.T) {
	t.Parallel()
	for _, layout := range []string{"group-commit", "batch-handler"} {
		for _, point := range []string{"claim", "handler", "effects", "commit"} {
			t.Run(layout+"/"+point, func(t *testing.T) {
				t.Parallel()
				testSetBasedBatchBackendCut(t, layout, point)
			})
		}
	}
}

func testSetBasedBatchBackendCut(t *testing.T, layout, point string) {
	ctx := context.Background()
	// Waits on a lock must be cut, not time out.
	long := func(cfg *consumer.Config) { cfg.LockTimeout = time.Minute }
	var (
		h        func(*message.Message) error
		b        *bundle
		inHand   = make(chan int32, 1) // the batch's backend, from inside the handler
		release  = make(chan struct{})
		holdOnce atomic.Bool
	)
	// hold blocks the handler of cutVictim once (point "handler") after its write,
	// until the test has cut the connection.
	hold := func(ctx context.Context, tx pgx.Tx, keys ...string) error {
		if point != "handler" {
			return nil
		}
		for _, k := range keys {
			if k == cutVictim && holdOnce.CompareAndSwap(false, true) {
				var pid int32
				if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
					return err
				}
				inHand <- pid
				<-release
			}
		}
		return nil
	}
	switch layout {
	case "group-commit":
		var c *consumer.Consumer
		c, b = setup(t, consumer.GroupCommit, batched, long)
		h = middlewareFunc(c.Middleware(b.bizHandler(func(msg *message.Message) error {
			return hold(msg.Context(), consumer.Tx(msg.Context()), msg.UUID)
		})))
	default:
		var bb *batchBiz
		h, bb, b = setupBatch(t, long)
		bb.after = func(ctx context.Context, tx pgx.Tx, msgs []*message.Message) error {
			keys := make([]string, len(msgs))
			for i, m := range msgs {
				keys[i] = m.UUID
			}
			return hold(ctx, tx, keys...)
		}
	}

	// For the lock points, another transaction holds what the batch needs for
	// cutVictim, uncommitted, so that the batch waits in that statement.
	var blocker pgx.Tx
	var blockerPID int32
	unblock := func() {}
	switch point {
	case "claim":
		// Another delivery of cutVictim holds its claim (Transactional mode).
		c2, err := consumer.New(consumer.Config{Name: "payments", Pool: b.pool, Schema: b.schema})
		require.NoError(t, err)
		t.Cleanup(func() { _ = c2.Close() })
		claimed, done := make(chan struct{}), make(chan error, 1)
		h2 := c2.Middleware(func(*message.Message) ([]*message.Message, error) {
			close(claimed)
			<-release
			return nil, fmt.Errorf("the other delivery fails transiently")
		})
		go func() { _, err := h2(newMsg(cutVictim, `{}`)); done <- err }()
		<-claimed
		t.Cleanup(func() { require.Error(t, <-done) })
	case "effects":
		var err error
		blocker, err = b.pool.Begin(ctx)
		require.NoError(t, err)
		_, err = effects.Enqueue(effects.WithScope(ctx, effects.Scope{Schema: b.schema}), blocker,
			effects.Effect{Kind: "email", Key: "receipt:" + cutVictim, Payload: []byte(`{}`)})
		require.NoError(t, err)
		require.NoError(t, blocker.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&blockerPID))
	case "commit":
		// A deferred trigger on cutVictim's business row waits, at COMMIT, for an
		// advisory lock the test holds: a key of its own, since advisory locks are
		// shared by the whole database and tests run in parallel.
		lock := strconv.FormatInt(rand.Int64(), 10)
		_, err := b.pool.Exec(ctx, `
			CREATE FUNCTION wait_for_test() RETURNS trigger LANGUAGE plpgsql AS $$
			BEGIN PERFORM pg_advisory_xact_lock(`+lock+`); RETURN NULL; END $$;
			CREATE CONSTRAINT TRIGGER wait_for_test AFTER INSERT ON biz DEFERRABLE INITIALLY DEFERRED
				FOR EACH ROW WHEN (NEW.key = '`+cutVictim+`') EXECUTE FUNCTION wait_for_test()`)
		require.NoError(t, err)
		conn, err := b.pool.Acquire(ctx)
		require.NoError(t, err)
		t.Cleanup(conn.Release)
		_, err = conn.Exec(ctx, `SELECT pg_advisory_lock(`+lock+`)`)
		require.NoError(t, err)
		require.NoError(t, conn.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&blockerPID))
		unblock = func() {
			_, err := conn.Exec(ctx, `SELECT pg_advisory_unlock_all()`)
			require.NoError(t, err)
		}
	}

	msgs := make([]*message.Message, len(cutKeys))
	for i, k := range cutKeys {
		msgs[i] = newMsg(k, `{}`)
	}
	var errs []error
	answered := make(chan struct{})
	go func() {
		defer close(answered)
		errs = sendTogether(h, msgs...)
	}()

	// Find the batch's backend, cut it, and wait until it is gone.
	var victim int32
	switch point {
	case "handler":
		victim = <-inHand
	default:
		// The backend that waits for a lock of the blocker (the other delivery's,
		// the test's transaction, or its advisory lock).
		pgtest.WaitFor(t, time.Minute, "the batch waits in its "+point+" statement", func() bool {
			// Only this test's backends (its pool's application_name): tests of other
			// packages wait on locks in the same database at the same time.
			err := b.pool.QueryRow(ctx, `SELECT pid FROM pg_stat_activity
				WHERE wait_event_type = 'Lock' AND application_name = $3
				AND query ILIKE $1 AND ($2 = 0 OR $2 = ANY(pg_blocking_pids(pid)))`,
				map[string]string{"claim": "%inbox%", "effects": "%effects%", "commit": "%idem.commit%"}[point], blockerPID,
				"idem-test:"+b.schema).Scan(&victim)
			return err == nil
		})
	}
	var cut bool
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT pg_terminate_backend($1)`, victim).Scan(&cut))
	require.True(t, cut)
	pgtest.WaitFor(t, time.Minute, "the cut backend is gone", func() bool {
		return pgtest.Count(t, b.pool, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1`, victim) == 0
	})
	close(release)
	if blocker != nil {
		require.NoError(t, blocker.Rollback(ctx))
	}
	unblock()
	<-answered

	// Every answer agrees with the inbox; then the broker redelivers the nacked
	// messages (all of them at once, as a batch) until each is acked.
	for i, key := range cutKeys {
		t.Logf("%s: %v", key, errs[i])
		requireAnswerAgreesWithInbox(t, b, key, errs[i])
	}
	for attempt := 0; ; attempt++ {
		var again []*message.Message
		var at []int
		for i, err := range errs {
			if err != nil {
				again = append(again, newMsg(cutKeys[i], `{}`))
				at = append(at, i)
			}
		}
		if len(again) == 0 {
			break
		}
		require.Less(t, attempt, 5, "still nacked: %v", errs)
		for j, err := range sendTogether(h, again...) {
			errs[at[j]] = err
		}
	}
	for _, key := range cutKeys {
		require.Equal(t, 1, b.bizRows(t, key), "%s committed once", key)
		state, _ := inboxState(t, b, key)
		require.Equal(t, "completed", state, key)
	}
	require.Equal(t, len(cutKeys), b.effectRows(t), "one receipt per message")
}

// requireAnswerAgreesWithInbox is requireAnswerMatchesInbox for a cut: a nack is
// transient and coded: the connection broke before COMMIT (database_unavailable,
// the driver's error inside), during it (commit_unknown), or another message's
// failure broke the batch (batch_aborted).
func requireAnswerAgreesWithInbox(t *testing.T, b *bundle, key string, err error) {
	t.Helper()
	if err == nil {
		requireAnswerMatchesInbox(t, b, key, err)
		return
	}
	require.False(t, consumer.IsPermanent(err), "%s: a cut is transient: %v", key, err)
	require.Contains(t, []string{"database_unavailable", "commit_unknown", "batch_aborted"}, inbox.Code(err), "%s: %v", key, err)
	state, _ := inboxState(t, b, key)
	require.Empty(t, state, "%s was nacked, so nothing of it is committed", key)
	require.Zero(t, b.bizRows(t, key), "%s was nacked, so nothing of it is committed", key)
}
