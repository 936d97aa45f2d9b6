package consumer_test

// Regression tests for issue 12 ("Hardening"), consumer part. Each runs over every
// mode where the behaviour applies (allModes), and states the guarantee as an
// invariant between the middleware's answer and what Postgres holds, so that it
// keeps holding for a future batch implementation of GroupCommit.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/pgtest"
)

var allModes = []consumer.Mode{consumer.Transactional, consumer.GroupCommit, consumer.Lease}

func forAllModes(t *testing.T, fn func(t *testing.T, mode consumer.Mode)) {
	for _, mode := range allModes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			fn(t, mode)
		})
	}
}

// batched makes GroupCommit gather the messages a test sends together into one
// batch; it changes nothing in the other modes.
func batched(cfg *consumer.Config) {
	cfg.MaxWait = 300 * time.Millisecond
	cfg.Workers = 1
}

// inboxState is the committed inbox row of key: "" when there is none.
func inboxState(t *testing.T, b *bundle, key string) (state, code string) {
	t.Helper()
	rows, err := b.pool.Query(context.Background(), `SELECT state, coalesce(error_code, '') FROM inbox WHERE key = $1`, key)
	require.NoError(t, err)
	defer rows.Close()
	for rows.Next() {
		require.NoError(t, rows.Scan(&state, &code))
	}
	require.NoError(t, rows.Err())
	return state, code
}

// requireAnswerMatchesInbox is the contract between the middleware's answer and the
// database: an ack (nil) means the key's row and its work are committed; a nack
// carries a stable code.
func requireAnswerMatchesInbox(t *testing.T, b *bundle, key string, err error) {
	t.Helper()
	if err == nil {
		state, _ := inboxState(t, b, key)
		require.Contains(t, []string{"completed", "failed"}, state, "%s was acked, so its inbox row must be committed", key)
		if state == "completed" {
			require.Equal(t, 1, b.bizRows(t, key), "%s was acked as completed, so its work must be committed", key)
		}
		return
	}
	require.NotEmpty(t, consumer.Code(err), "%s: every nack has a stable code: %v", key, err)
}

// Issue 12, item 1. A handler that forwards the message it received must not have
// that message's UUID rewritten: under the documented stack (Retry outside idem), a
// commit that fails once is retried with the same key, and a later redelivery of
// the message is a duplicate. Rewritten, the retry claimed the output UUID and the
// redelivery ran the work a second time under the original key.
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
		defer pubsub.Close()
		retry := middleware.Retry{MaxRetries: 5, InitialInterval: time.Millisecond, ShouldRetry: consumer.ShouldRetry}
		runRouter(t, pubsub, forward, retry.Middleware, c.Middleware)

		require.NoError(t, pubsub.Publish("in", message.NewMessage("fwd-1", []byte(`{"n":1}`))))
		eventually(t, "the retried commit", func() bool { return b.counter("idem_inbox_processed_total") == 1 })
		// The broker delivers the same message again (a lost ack, a rebalance).
		require.NoError(t, pubsub.Publish("in", message.NewMessage("fwd-1", []byte(`{"n":1}`))))
		eventually(t, "the redelivery", func() bool {
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
		out, err := effects.DecodeMessage(stored)
		require.NoError(t, err)
		require.Equal(t, consumer.OutputUUID("payments", "", "fwd-1", 0), out.UUID, "the stored copy has the derived UUID")
		require.Equal(t, `{"n":1}`, string(out.Payload))
	})
}

// Issue 12, item 2 (the aborted case). A handler that swallows a failed statement and
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
			require.Equal(t, "tx_aborted", consumer.Code(errs[i]))
			require.False(t, consumer.IsPermanent(errs[i]))
		}
		misbehave.Store(false)
		_, err := h(newMsg("k", `{}`))
		require.NoError(t, err)
		require.Equal(t, 1, b.bizRows(t, "k"))
	})
}

// Issue 12, item 4. With the tables missing, every message of a batch fails with a
// coded error, the first one with ErrSchemaMissing itself, and no answer is a bare
// error about a savepoint that never ran.
func TestMissingSchemaSurfacesInEveryMode(t *testing.T) {
	t.Parallel()
	forAllModes(t, func(t *testing.T, mode consumer.Mode) {
		pool, schema := pgtest.Setup(t, pgtest.Options{NoMigrate: true})
		cfg := consumer.Config{Name: "x", Pool: pool, Schema: schema, Mode: mode, BusyDelay: time.Millisecond}
		batched(&cfg)
		c, err := consumer.New(cfg)
		require.NoError(t, err)
		t.Cleanup(func() { _ = c.Close() })
		var calls atomic.Int64
		h := c.Middleware(func(*message.Message) ([]*message.Message, error) {
			calls.Add(1)
			return nil, nil
		})
		keys := []string{"a", "b", "c", "d"}
		errs := make([]error, len(keys))
		var wg sync.WaitGroup
		for i, key := range keys {
			wg.Go(func() { _, errs[i] = h(newMsg(key, `{}`)) })
		}
		wg.Wait()
		missing := 0
		for i, err := range errs {
			require.Error(t, err, keys[i])
			require.False(t, consumer.IsPermanent(err), "a missing schema is nacked, never recorded")
			require.NotContains(t, err.Error(), "savepoint", "the real cause, not the rollback's error")
			switch consumer.Code(err) {
			case "schema_missing":
				require.ErrorIs(t, err, consumer.ErrSchemaMissing)
				require.Contains(t, err.Error(), "idem migrate up")
				missing++
			case "batch_aborted":
				require.Equal(t, consumer.GroupCommit, mode)
				require.Contains(t, err.Error(), "idem migrate up", "names the first message's cause")
			default:
				t.Fatalf("%s: unexpected code %q: %v", keys[i], consumer.Code(err), err)
			}
		}
		require.Positive(t, missing, "the first error surfaces with its own code")
		require.Zero(t, calls.Load())
	})
}

// Issue 12, item 5. Close races the first message without a data race (run with
// -race), is final (a message after it gets ErrClosed, nacked), and can be called
// twice.
func TestCloseIsSafeAtAnyTimeAndFinal(t *testing.T) {
	t.Parallel()
	forAllModes(t, func(t *testing.T, mode consumer.Mode) {
		pool, schema := pgtest.Setup(t)
		for i := range 20 {
			c, err := consumer.New(consumer.Config{Name: "payments", Pool: pool, Schema: schema, Mode: mode})
			require.NoError(t, err)
			h := c.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
			racing := make(chan error, 1)
			go func() {
				_, err := h(newMsg(fmt.Sprintf("race-%d", i), `{}`))
				racing <- err
			}()
			require.NoError(t, c.Close())
			if err := <-racing; err != nil {
				require.ErrorIs(t, err, consumer.ErrClosed, "the racing message is handled or refused")
			}
			_, err = h(newMsg(fmt.Sprintf("after-%d", i), `{}`))
			require.ErrorIs(t, err, consumer.ErrClosed)
			require.Equal(t, "closed", consumer.Code(err))
			require.False(t, consumer.IsPermanent(err), "nacked, not poisoned")
			require.NoError(t, c.Close(), "a second Close is a no-op")
		}
		require.Zero(t, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE key LIKE 'after-%'`))
	})
}

// Issue 12, item 6. A handler that panics leaves its key free in every mode: the
// redelivery runs at once (in Lease mode it used to wait out the lease).
// Transactional and Lease mode panic on, for a Recoverer outside; GroupCommit
// recovers on its worker and returns an error.
func TestPanickingHandlerLeavesTheKeyFree(t *testing.T) {
	t.Parallel()
	forAllModes(t, func(t *testing.T, mode consumer.Mode) {
		c, b := setup(t, mode, func(cfg *consumer.Config) { cfg.Lease = time.Hour })
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

// Issue 12, item 7. A message whose context is cancelled after its handler
// succeeded and before COMMIT was sent is reported as what happened: nothing
// committed, ErrCanceled (transient, code "canceled"), never commit_unknown. In
// GroupCommit mode a batch does not listen to one message's context, so it commits.
func TestContextCancelledBeforeCommit(t *testing.T) {
	t.Parallel()
	forAllModes(t, func(t *testing.T, mode consumer.Mode) {
		c, b := setup(t, mode, func(cfg *consumer.Config) { cfg.Lease = time.Hour })
		var cancelIt atomic.Bool
		cancelIt.Store(true)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		h := c.Middleware(b.bizHandler(func(*message.Message) error {
			if cancelIt.Load() {
				cancel() // the partition is revoked as the handler returns
			}
			return nil
		}))
		msg := newMsg("c-1", `{}`)
		msg.SetContext(ctx)
		_, err := h(msg)
		requireAnswerMatchesInbox(t, b, "c-1", err)
		if mode == consumer.GroupCommit {
			require.NoError(t, err)
		} else {
			require.ErrorIs(t, err, consumer.ErrCanceled)
			require.NotErrorIs(t, err, consumer.ErrCommitUnknown)
			require.Equal(t, "canceled", consumer.Code(err))
			require.False(t, consumer.IsPermanent(err))
			require.Equal(t, 0, b.bizRows(t, "c-1"))
			state, _ := inboxState(t, b, "c-1")
			require.Contains(t, []string{"", "processing"}, state, "nothing committed")
		}

		cancelIt.Store(false)
		_, err = h(newMsg("c-1", `{}`))
		require.NoError(t, err, "the redelivery settles it at once (in Lease mode, the lease was given back)")
		require.Equal(t, 1, b.bizRows(t, "c-1"))
	})
}

// Issue 12, item 7. A COMMIT in flight is not cut by the message's cancellation: it
// finishes, and the answer says it committed. The COMMIT is held at a deferred
// trigger that waits for an advisory lock the test holds; the test cancels the
// message's context while it waits, then lets it go.
func TestCommitInFlightIsNotCancelled(t *testing.T) {
	t.Parallel()
	forAllModes(t, func(t *testing.T, mode consumer.Mode) {
		c, b := setup(t, mode, func(cfg *consumer.Config) { cfg.Lease = time.Hour })
		ctx := context.Background()
		_, err := b.pool.Exec(ctx, `
			CREATE FUNCTION hold_commit() RETURNS trigger LANGUAGE plpgsql AS $$
			BEGIN
				PERFORM pg_advisory_xact_lock(hashtext(current_schema()));
				RETURN NULL;
			END $$;
			CREATE CONSTRAINT TRIGGER hold_commit AFTER INSERT ON biz
				DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION hold_commit();`)
		require.NoError(t, err)
		holder, err := b.pool.Acquire(ctx)
		require.NoError(t, err)
		defer holder.Release()
		_, err = holder.Exec(ctx, `SELECT pg_advisory_lock(hashtext(current_schema()))`)
		require.NoError(t, err)
		released := false
		unlock := func() {
			if !released {
				released = true
				_, err := holder.Exec(ctx, `SELECT pg_advisory_unlock(hashtext(current_schema()))`)
				require.NoError(t, err)
			}
		}
		defer unlock()

		var pid atomic.Int64
		h := c.Middleware(b.bizHandler(func(msg *message.Message) error {
			var p int64
			err := consumer.Tx(msg.Context()).QueryRow(msg.Context(), `SELECT pg_backend_pid()`).Scan(&p)
			pid.Store(p)
			return err
		}))
		msgCtx, cancel := context.WithCancel(ctx)
		defer cancel()
		msg := newMsg("f-1", `{}`)
		msg.SetContext(msgCtx)
		answer := make(chan error, 1)
		go func() {
			_, err := h(msg)
			answer <- err
		}()
		eventually(t, "the COMMIT to wait at the trigger", func() bool {
			var waiting bool
			err := b.pool.QueryRow(ctx, `SELECT coalesce(bool_or(wait_event_type = 'Lock' AND query ILIKE '%commit%'), false)
				FROM pg_stat_activity WHERE pid = $1`, pid.Load()).Scan(&waiting)
			return err == nil && waiting
		})
		cancel()
		// The COMMIT still waits at the trigger, so no answer may come yet. (pgx cut
		// a COMMIT sent under the message's context at once, and answered
		// commit_unknown, though it went on to commit.)
		select {
		case err := <-answer:
			t.Fatalf("answered while its COMMIT was still waiting: %v", err)
		case <-time.After(200 * time.Millisecond):
		}
		unlock()
		select {
		case err = <-answer:
		case <-time.After(60 * time.Second):
			t.Fatal("no answer")
		}
		require.NoError(t, err, "the COMMIT finished, so the answer is an ack")
		requireAnswerMatchesInbox(t, b, "f-1", err)
	})
}

// Issue 12, item 17. A BusinessKey error has its own code and is permanent but never
// recorded (there is no key). Without a PoisonQueue the message is returned as an
// error, so it is nacked; with a PoisonQueue outside idem it goes to the poison topic.
func TestBusinessKeyErrorIsCodedAndPoisonable(t *testing.T) {
	t.Parallel()
	forAllModes(t, func(t *testing.T, mode consumer.Mode) {
		errNoID := errors.New("payload has no payment_id")
		key := consumer.BusinessKey(func(payload []byte) (string, error) {
			if !strings.HasPrefix(string(payload), "pay:") {
				return "", errNoID
			}
			return string(payload), nil
		})
		c, b := setup(t, mode, func(cfg *consumer.Config) {
			cfg.Key = key
			cfg.OnPermanent = consumer.PoisonOnPermanent // it must not matter
		})
		// Without a PoisonQueue: the error comes back, so the message is nacked.
		h := c.Middleware(b.bizHandler(nil))
		_, err := h(newMsg("m-1", `{"amount":1}`))
		require.ErrorIs(t, err, consumer.ErrBusinessKey)
		require.ErrorIs(t, err, errNoID, "the key function's own error is kept")
		require.Equal(t, "business_key", consumer.Code(err))
		require.True(t, consumer.IsPermanent(err), "so a PoisonQueue filtered on IsPermanent takes it")
		require.Zero(t, b.calls.Load())
		require.Zero(t, pgtest.Count(t, b.pool, `SELECT count(*) FROM inbox`), "nothing to record it under")
		require.Equal(t, 1.0, series(t, b.reg, "idem_inbox_failed_total", map[string]string{"code": "business_key"}))

		// With the documented stack, the poison topic takes it and the rest flows.
		pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, watermill.NopLogger{})
		defer pubsub.Close()
		poisoned, err := pubsub.Subscribe(context.Background(), "poison")
		require.NoError(t, err)
		poison, err := middleware.PoisonQueueWithFilter(pubsub, "poison", consumer.IsPermanent)
		require.NoError(t, err)
		retry := middleware.Retry{MaxRetries: 3, InitialInterval: time.Millisecond, ShouldRetry: consumer.ShouldRetry}
		runRouter(t, pubsub, b.bizHandler(nil), poison, retry.Middleware, c.Middleware)
		require.NoError(t, pubsub.Publish("in",
			message.NewMessage("m-2", []byte(`{"amount":2}`)),
			message.NewMessage("m-3", []byte(`pay:3`))))
		select {
		case m := <-poisoned:
			require.Equal(t, "m-2", m.UUID)
			require.Contains(t, m.Metadata.Get(middleware.ReasonForPoisonedKey), "business key")
			m.Ack()
		case <-time.After(30 * time.Second):
			t.Fatal("the malformed message was not poisoned")
		}
		eventually(t, "the good message", func() bool { return b.bizRows(t, "m-3") == 1 })
		require.EqualValues(t, 1, b.calls.Load(), "the key function failed before any claim, so the handler never ran for it")
	})
}

// Issue 12, item 13 (consumer part). Every series a dashboard needs exists at zero
// before the first message: at New when Config.Name is set, and at a name's first
// message when the name comes from the Watermill handler.
func TestMetricSeriesExistFromTheStart(t *testing.T) {
	t.Parallel()
	want := []struct {
		name   string
		labels map[string]string
	}{
		{"idem_inbox_processed_total", nil},
		{"idem_inbox_duplicates_total", nil},
		{"idem_inbox_duplicate_age_seconds", nil},
		{"idem_inbox_fingerprint_mismatch_total", nil},
		{"idem_inbox_lock_wait_seconds", nil},
		{"idem_inbox_expired_retry_total", nil},
		{"idem_inbox_failed_total", map[string]string{"code": "permanent", "replayed": "false"}},
		{"idem_inbox_failed_total", map[string]string{"code": "permanent", "replayed": "true"}},
		{"idem_inbox_failed_total", map[string]string{"code": "business_key", "replayed": "false"}},
		{"idem_inbox_nacked_total", map[string]string{"code": "transient"}},
		{"idem_inbox_nacked_total", map[string]string{"code": "busy"}},
		{"idem_inbox_nacked_total", map[string]string{"code": "commit_unknown"}},
		{"idem_inbox_nacked_total", map[string]string{"code": "database_unavailable"}},
		{"idem_inbox_nacked_total", map[string]string{"code": "message_not_in_batch"}},
		{"idem_inbox_failed_total", map[string]string{"code": "handler_ended_transaction", "replayed": "false"}},
		{"idem_inbox_failed_total", map[string]string{"code": "handler_ended_transaction", "replayed": "true"}},
		{"idem_inbox_nacked_total", map[string]string{"code": "schema_missing"}},
	}
	check := func(t *testing.T, b *bundle, consumerName string) {
		t.Helper()
		mfs, err := b.reg.Gather()
		require.NoError(t, err)
		for _, w := range want {
			labels := map[string]string{"consumer": consumerName}
			for k, v := range w.labels {
				labels[k] = v
			}
			found := slices.ContainsFunc(mfs, func(mf *dto.MetricFamily) bool {
				return mf.GetName() == w.name && slices.ContainsFunc(mf.GetMetric(), func(m *dto.Metric) bool { return hasLabels(m, labels) })
			})
			require.True(t, found, "series %s%v missing", w.name, labels)
		}
	}
	forAllModes(t, func(t *testing.T, mode consumer.Mode) {
		t.Run("Name set", func(t *testing.T) {
			_, b := setup(t, mode)
			check(t, b, "payments") // before any message
			require.Zero(t, series(t, b.reg, "idem_inbox_processed_total", nil))
		})
		t.Run("Name from the handler", func(t *testing.T) {
			c, b := setup(t, mode, func(cfg *consumer.Config) { cfg.Name = "" })
			pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, watermill.NopLogger{})
			defer pubsub.Close()
			runRouter(t, pubsub, b.bizHandler(nil), c.Middleware)
			require.NoError(t, pubsub.Publish("in", message.NewMessage("first", []byte(`{}`))))
			eventually(t, "the first message", func() bool { return b.counter("idem_inbox_processed_total") == 1 })
			check(t, b, "payments") // the router's handler name
			require.Zero(t, series(t, b.reg, "idem_inbox_duplicates_total", nil))
		})
	})
}
