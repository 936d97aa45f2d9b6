package consumer_test

// A handler's behaviour and what it costs: a forwarded message keeps its
// identity, a swallowed failed statement costs only its own message, a panic
// leaves the key free. Each test runs over every mode where the behaviour
// applies, and states the guarantee as an invariant between the middleware's
// answer and what Postgres holds.

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/pgtest"
)

// A handler that forwards the message it received must not have
// that message's UUID rewritten: under the documented stack (Retry outside idem), a
// commit that fails once is retried with the same key, and a later redelivery of
// the message is a duplicate. Were the UUID rewritten, the retry would claim the
// output UUID and the redelivery would run the work a second time under the
// original key.
func TestForwardingHandlerKeepsItsInputsIdentity(t *testing.T) {
	t.Parallel()
	forAllModes(t, func(t *testing.T, mode consumer.Mode) {
		c, b := setup(t, mode, func(cfg *consumer.Config) { cfg.Name = "" })
		ctx := context.Background()
		// The first COMMIT that carries a business row fails: a deferred trigger
		// raises at commit time, once (a sequence does not roll back).
		_, err := b.pool.Exec(ctx, `
			CREATE SEQUENCE commit_failures;
			CREATE FUNCTION fail_first_commit() RETURNS trigger LANGUAGE plpgsql AS $$
			BEGIN
				IF nextval('commit_failures') = 1 THEN
					RAISE EXCEPTION 'injected commit failure';
				END IF;
				RETURN NULL;
			END $$;
			CREATE CONSTRAINT TRIGGER fail_first_commit AFTER INSERT ON biz
				DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION fail_first_commit();`)
		require.NoError(t, err)

		var mu sync.Mutex
		var seen []string
		other := message.NewMessage("made-elsewhere", []byte("x")) // not the handler's either
		forward := func(msg *message.Message) ([]*message.Message, error) {
			mu.Lock()
			seen = append(seen, msg.UUID)
			mu.Unlock()
			ctx := msg.Context()
			if _, err := consumer.Tx(ctx).Exec(ctx, `INSERT INTO biz (key) VALUES ($1)`, msg.UUID); err != nil {
				return nil, err
			}
			return []*message.Message{msg, other}, nil // forward the input as it is
		}
		pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, watermill.NopLogger{})
		defer func() { require.NoError(t, pubsub.Close()) }()
		retry := middleware.Retry{MaxRetries: 5, InitialInterval: time.Millisecond, ShouldRetry: consumer.ShouldRetry}
		runRouter(t, pubsub, forward, retry.Middleware, c.Middleware)

		require.NoError(t, pubsub.Publish("in", message.NewMessage("fwd-1", []byte(`{"n":1}`))))
		pgtest.WaitFor(t, time.Minute, "the retried commit", func() bool { return b.counter("idem_inbox_processed_total") == 1 })
		// The broker delivers the same message again (a lost ack, a rebalance).
		require.NoError(t, pubsub.Publish("in", message.NewMessage("fwd-1", []byte(`{"n":1}`))))
		pgtest.WaitFor(t, time.Minute, "the redelivery", func() bool {
			return b.counter("idem_inbox_processed_total")+b.counter("idem_inbox_duplicates_total") >= 2
		})

		require.EqualValues(t, 1, b.counter("idem_inbox_processed_total"))
		require.EqualValues(t, 1, b.counter("idem_inbox_duplicates_total"))
		require.Equal(t, 1, pgtest.Count(t, b.pool, `SELECT count(*) FROM biz`), "the work committed once")
		require.Equal(t, 1, b.bizRows(t, "fwd-1"))
		require.Equal(t, 1, pgtest.Count(t, b.pool, `SELECT count(*) FROM inbox`))
		state, _ := inboxState(t, b, "fwd-1")
		require.Equal(t, "completed", state)
		mu.Lock()
		require.Equal(t, []string{"fwd-1", "fwd-1"}, seen, "every attempt saw the input's own UUID")
		require.Equal(t, "made-elsewhere", other.UUID)
		mu.Unlock()

		var stored []byte
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT payload FROM effects WHERE kind = 'publish:out' AND key = $1`,
			consumer.OutputUUID("payments", "", "fwd-1", 0)).Scan(&stored))
		out, err := effectsdb.DecodeMessage(stored)
		require.NoError(t, err)
		require.Equal(t, consumer.OutputUUID("payments", "", "fwd-1", 0), out.UUID, "the stored copy has the derived UUID")
		require.Equal(t, `{"n":1}`, string(out.Payload))
	})
}

// A handler that swallows a failed statement and
// returns nil gets ErrTxAborted; in a batch it costs only itself.
func TestHandlerSwallowingAFailedStatementCostsOnlyItself(t *testing.T) {
	t.Parallel()
	forAllModes(t, func(t *testing.T, mode consumer.Mode) {
		c, b := setup(t, mode, batched)
		var misbehave atomic.Bool
		misbehave.Store(true)
		h := c.Middleware(b.bizHandler(func(msg *message.Message) error {
			if msg.UUID == "k" && misbehave.Load() {
				_, _ = consumer.Tx(msg.Context()).Exec(msg.Context(), `SELECT 1/0`) // error ignored
			}
			return nil
		}))
		keys := []string{"a", "k", "m"}
		errs := make([]error, len(keys))
		var wg sync.WaitGroup
		for i, key := range keys {
			wg.Go(func() { _, errs[i] = h(newMsg(key, `{}`)) })
		}
		wg.Wait()
		for i, key := range keys {
			requireAnswerMatchesInbox(t, b, key, errs[i])
			if key != "k" {
				require.NoError(t, errs[i], key)
				continue
			}
			require.ErrorIs(t, errs[i], consumer.ErrTxAborted)
			require.Equal(t, "tx_aborted", inbox.Code(errs[i]))
			require.False(t, consumer.IsPermanent(errs[i]))
		}
		misbehave.Store(false)
		_, err := h(newMsg("k", `{}`))
		require.NoError(t, err)
		require.Equal(t, 1, b.bizRows(t, "k"))
	})
}

// A handler that panics leaves its key free in every mode: the
// redelivery runs at once, in Lease mode too (it does not wait out the lease).
// Transactional and Lease mode panic on, for a Recoverer outside; GroupCommit
// recovers on its worker and returns an error.
func TestPanickingHandlerLeavesTheKeyFree(t *testing.T) {
	t.Parallel()
	forAllModes(t, func(t *testing.T, mode consumer.Mode) {
		c, b := setup(t, mode, leaseMode(time.Hour))
		var n atomic.Int64
		h := c.Middleware(b.bizHandler(func(*message.Message) error {
			if n.Add(1) == 1 {
				panic("boom")
			}
			return nil
		}))
		var recovered any
		err := func() (err error) {
			defer func() { recovered = recover() }()
			_, err = h(newMsg("p-1", `{}`))
			return err
		}()
		if mode == consumer.GroupCommit {
			require.ErrorContains(t, err, "boom")
		} else {
			require.Equal(t, "boom", recovered, "the panic goes on to a Recoverer outside")
		}
		require.Equal(t, 0, b.bizRows(t, "p-1"))

		_, err = h(newMsg("p-1", `{}`))
		require.NoError(t, err, "the redelivery runs at once")
		require.Equal(t, 1, b.bizRows(t, "p-1"))
		require.EqualValues(t, 2, n.Load())
	})
}
