package consumer_test

// Coded errors as the answer to a message: a missing schema, a message without a
// business key.

import (
	"context"
	"errors"
	"strings"
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
	"github.com/idemkit/idem/internal/pgtest"
)

// With the tables missing, every message of a batch fails with a
// coded error, the first one with ErrSchemaMissing itself, and no answer is a bare
// error about a savepoint that never ran.
func TestMissingSchemaSurfacesInEveryMode(t *testing.T) {
	t.Parallel()
	forAllModes(t, func(t *testing.T, mode consumer.Mode) {
		pool, schema := pgtest.Setup(t, pgtest.Options{NoMigrate: true})
		// Skipped, New's check would refuse the schema (TestNewChecksTheSchema).
		cfg := consumer.Config{Name: "x", Pool: pool, Schema: schema, Mode: mode, BusyDelay: time.Millisecond, SkipSchemaCheck: true}
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
			switch inbox.Code(err) {
			case "schema_missing":
				require.ErrorIs(t, err, consumer.ErrSchemaMissing)
				require.Contains(t, err.Error(), "idem migrate up")
				missing++
			case "batch_aborted":
				require.Equal(t, consumer.GroupCommit, mode)
				require.Contains(t, err.Error(), "idem migrate up", "names the first message's cause")
			default:
				t.Fatalf("%s: unexpected code %q: %v", keys[i], inbox.Code(err), err)
			}
		}
		require.Positive(t, missing, "the first error surfaces with its own code")
		require.Zero(t, calls.Load())
	})
}

// A BusinessKey error has its own code and is permanent but never
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
			cfg.PoisonOnPermanent = true // it must not matter
		})
		// Without a PoisonQueue: the error comes back, so the message is nacked.
		h := c.Middleware(b.bizHandler(nil))
		_, err := h(newMsg("m-1", `{"amount":1}`))
		require.ErrorIs(t, err, consumer.ErrBusinessKey)
		require.ErrorIs(t, err, errNoID, "the key function's own error is kept")
		require.Equal(t, "business_key", inbox.Code(err))
		require.True(t, consumer.IsPermanent(err), "so a PoisonQueue filtered on IsPermanent takes it")
		require.Zero(t, b.calls.Load())
		require.Zero(t, pgtest.Count(t, b.pool, `SELECT count(*) FROM inbox`), "nothing to record it under")
		require.Equal(t, 1.0, series(t, b.reg, "idem_inbox_failed_total", map[string]string{"code": "business_key"}))

		// With the documented stack, the poison topic takes it and the rest flows.
		pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, watermill.NopLogger{})
		defer func() { require.NoError(t, pubsub.Close()) }()
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
		pgtest.WaitFor(t, time.Minute, "the good message", func() bool { return b.bizRows(t, "m-3") == 1 })
		require.EqualValues(t, 1, b.calls.Load(), "the key function failed before any claim, so the handler never ran for it")
	})
}
