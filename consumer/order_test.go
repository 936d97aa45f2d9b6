package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/pgtest"
)

// answers is the outermost middleware of an order test: it passes on what the
// chain inside returned for each delivery, and acks it, so that a refused message
// is not redelivered in a loop by the in-memory broker.
type answers chan error

func (a answers) middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		_, err := h(msg)
		a <- err
		return nil, nil
	}
}

func (a answers) next(t *testing.T) error {
	t.Helper()
	select {
	case err := <-a:
		return err
	case <-time.After(30 * time.Second):
		t.Fatal("no delivery was answered")
		return nil
	}
}

// A handler whose first attempt inserts its ledger row and then fails, under
// Watermill's real Retry and PoisonQueue, in every order: with idem innermost the
// retry commits one row; with Retry or PoisonQueue inside idem, idem refuses the
// message (middleware_order, nacked) and nothing commits: no ledger row, no inbox
// row, and nothing poisoned or acked as done.
func TestMiddlewareOrderEnforced(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, mode consumer.Mode) {
		c, b := setup(t, mode, func(cfg *consumer.Config) { cfg.Name = "" })
		pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, watermill.NopLogger{})
		defer func() { require.NoError(t, pubsub.Close()) }()
		poisoned, err := pubsub.Subscribe(context.Background(), "poison")
		require.NoError(t, err)
		poison, err := middleware.PoisonQueue(pubsub, "poison")
		require.NoError(t, err)
		poisonFiltered, err := middleware.PoisonQueueWithFilter(pubsub, "poison", consumer.IsPermanent)
		require.NoError(t, err)
		retry := middleware.Retry{MaxRetries: 3, InitialInterval: time.Millisecond, ShouldRetry: consumer.ShouldRetry}

		// Each case's message fails once, after its insert.
		var tries = map[string]*atomic.Int64{}
		for _, id := range []string{"right", "retry-inside", "poison-inside", "filtered-inside", "poison-hidden"} {
			tries[id] = new(atomic.Int64)
		}
		h := b.bizHandler(func(msg *message.Message) error {
			if tries[msg.UUID].Add(1) == 1 {
				return fmt.Errorf("connection reset")
			}
			return nil
		})
		inboxRows := func(key string) int {
			return pgtest.Count(t, b.pool, `SELECT count(*) FROM inbox WHERE key = $1`, key)
		}
		cases := []struct {
			id  string
			mws func(a answers) []message.HandlerMiddleware
			// ran: the handler runs (the refusal comes after it).
			ran bool
		}{
			{id: "retry-inside", mws: func(a answers) []message.HandlerMiddleware {
				return []message.HandlerMiddleware{a.middleware, c.Middleware, retry.Middleware, poisonFiltered}
			}},
			{id: "poison-inside", mws: func(a answers) []message.HandlerMiddleware {
				return []message.HandlerMiddleware{a.middleware, retry.Middleware, c.Middleware, poison}
			}},
			{id: "filtered-inside", mws: func(a answers) []message.HandlerMiddleware {
				return []message.HandlerMiddleware{a.middleware, c.Middleware, poisonFiltered}
			}},
			// Behind the Recoverer the PoisonQueue's name is hidden; its mark on
			// the message is not.
			{id: "poison-hidden", ran: true, mws: func(a answers) []message.HandlerMiddleware {
				return []message.HandlerMiddleware{a.middleware, c.Middleware, middleware.Recoverer, poison}
			}},
		}
		for _, tc := range cases {
			a := make(answers, 8)
			r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
			require.NoError(t, err)
			r.AddHandler("payments-"+tc.id, "in-"+tc.id, pubsub, "out", pubsub, h).AddMiddleware(tc.mws(a)...)
			startRouter(t, r)
			require.NoError(t, pubsub.Publish("in-"+tc.id, newMsg(tc.id, "{}")))
			err = a.next(t)
			require.ErrorIs(t, err, consumer.ErrMiddlewareOrder, tc.id)
			require.Equal(t, "middleware_order", inbox.Code(err), tc.id)
			require.False(t, consumer.IsPermanent(err), "nacked, not recorded")
			require.Equal(t, 0, b.bizRows(t, tc.id), "%s: a failed attempt's insert committed", tc.id)
			require.Equal(t, 0, inboxRows(tc.id), "%s: the key is recorded", tc.id)
			require.NoError(t, pubsub.Publish("in-"+tc.id, newMsg(tc.id, "{}")))
			err = a.next(t)
			if tc.ran {
				// The second attempt succeeds, and commits its one row.
				require.NoError(t, err, tc.id)
				require.Equal(t, 1, b.bizRows(t, tc.id), tc.id)
				require.Equal(t, 1, inboxRows(tc.id), tc.id)
				continue
			}
			// Refused at every delivery, before the handler runs.
			require.ErrorIs(t, err, consumer.ErrMiddlewareOrder, tc.id)
			require.Equal(t, 0, b.bizRows(t, tc.id), tc.id)
			require.Equal(t, 0, inboxRows(tc.id), tc.id)
			require.EqualValues(t, 0, tries[tc.id].Load(), "%s: the handler ran", tc.id)
		}
		// Only the hidden PoisonQueue ran the handler, and poisoned its first
		// attempt (the poison topic has a copy, which is all it can do); its
		// writes rolled back, and the message was not acked as done.
		select {
		case m := <-poisoned:
			require.Equal(t, "poison-hidden", m.UUID)
			m.Ack()
		case <-time.After(30 * time.Second):
			t.Fatal("the hidden PoisonQueue did not poison")
		}

		// The right order: the first attempt rolls back, the retry commits once.
		runRouter(t, pubsub, h, poisonFiltered, retry.Middleware, c.Middleware)
		require.NoError(t, pubsub.Publish("in", newMsg("right", "{}")))
		pgtest.WaitFor(t, time.Minute, "the retried message to commit", func() bool { return inboxRows("right") == 1 })
		require.Equal(t, 1, b.bizRows(t, "right"))
		require.EqualValues(t, 2, tries["right"].Load())
	})
}

// HandleBatch's handler is the innermost: Retry and PoisonQueue added to its router
// handler are outside idem, the right order, and a first call that fails after its
// insert commits nothing.
func TestMiddlewareOrderBatchHandler(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, mode consumer.Mode) {
		c, b := setup(t, mode, func(cfg *consumer.Config) { cfg.Name = "" })
		pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, watermill.NopLogger{})
		defer func() { require.NoError(t, pubsub.Close()) }()
		poison, err := middleware.PoisonQueueWithFilter(pubsub, "poison", consumer.IsPermanent)
		require.NoError(t, err)
		retry := middleware.Retry{MaxRetries: 3, InitialInterval: time.Millisecond, ShouldRetry: consumer.ShouldRetry}
		var calls atomic.Int64
		bh := c.HandleBatch(func(ctx context.Context, tx pgx.Tx, msgs []*message.Message) error {
			for _, m := range msgs {
				if _, err := tx.Exec(ctx, `INSERT INTO biz (key) VALUES ($1)`, m.UUID); err != nil {
					return err
				}
			}
			if calls.Add(1) == 1 {
				return errors.New("connection reset")
			}
			return nil
		})
		r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
		require.NoError(t, err)
		r.AddConsumerHandler("payments", "in", pubsub, bh).AddMiddleware(poison, retry.Middleware)
		startRouter(t, r)
		require.NoError(t, pubsub.Publish("in", newMsg("b-1", "{}")))
		pgtest.WaitFor(t, time.Minute, "the retried batch to commit", func() bool {
			return pgtest.Count(t, b.pool, `SELECT count(*) FROM inbox WHERE key = 'b-1'`) == 1
		})
		require.Equal(t, 1, b.bizRows(t, "b-1"))
		require.EqualValues(t, 2, calls.Load())
	})
}

// startRouter runs r until the test ends.
func startRouter(t *testing.T, r *message.Router) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = r.Run(ctx)
	}()
	<-r.Running()
	t.Cleanup(func() {
		cancel()
		<-done
	})
}
