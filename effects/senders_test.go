package effects_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/pgtest"
)

func TestPublishSenderKeepsUUIDAndMetadata(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 10}, watermill.NopLogger{})
	defer func() { require.NoError(t, pubsub.Close()) }()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	msgs, err := pubsub.Subscribe(ctx, "orders")
	require.NoError(t, err)

	out := message.NewMessage("0190b6c2-7d1e-7000-8000-000000000001", []byte(`{"order":42}`))
	out.Metadata.Set("trace_id", "abc")
	e, err := effects.PublishEffect("orders", out)
	require.NoError(t, err)
	enqueue(t, pool, schema, e, effects.Effect{Kind: effects.PublishKindPrefix + "orders", Key: "garbage", Payload: []byte("not json")})

	start(t, fastConfig(pool, schema, effects.PublishSenders(pubsub, "orders")))
	select {
	case got := <-msgs:
		got.Ack()
		require.Equal(t, out.UUID, got.UUID)
		require.Equal(t, "abc", got.Metadata.Get("trace_id"))
		require.JSONEq(t, `{"order":42}`, string(got.Payload))
	case <-time.After(10 * time.Second):
		t.Fatal("message not published")
	}
	waitState(t, pool, "publish:orders", out.UUID, "done", 30*time.Second)
	r := waitState(t, pool, "publish:orders", "garbage", "dead", 30*time.Second)
	require.Contains(t, r.LastError, "decode stored message")
}

func TestLedgerSender(t *testing.T) {
	t.Parallel()
	pool, schema := setup(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE ledger (effect_key text PRIMARY KEY, payload jsonb NOT NULL, kind text NOT NULL)`)
	require.NoError(t, err)
	ledger, err := effects.NewLedgerSender(effects.LedgerConfig{Pool: pool, Table: schema + ".ledger", KindColumn: "kind"})
	require.NoError(t, err)

	enqueue(t, pool, schema, effects.Effect{Kind: "ledger", Key: "credit:pay_789", Payload: []byte(`{"amount":1000}`)})
	start(t, fastConfig(pool, schema, map[string]effects.Sender{"ledger": ledger}))
	waitState(t, pool, "ledger", "credit:pay_789", "done", 30*time.Second)

	// Idempotent by construction: another attempt adds nothing.
	require.NoError(t, ledger.Send(ctx, effects.Delivery{Kind: "ledger", Key: "credit:pay_789", Payload: []byte(`{"amount":1000}`)}))
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM ledger WHERE effect_key = 'credit:pay_789' AND kind = 'ledger' AND payload = '{"amount":1000}'`))

	// A payload the column cannot take is permanent.
	err = ledger.Send(ctx, effects.Delivery{Kind: "ledger", Key: "bad", Payload: []byte(`not json`)})
	require.True(t, inbox.IsPermanent(err), "%v", err)

	for _, bad := range []string{"", "Ledger", "a.b.c", `x"; DROP TABLE ledger; --`} {
		_, err := effects.NewLedgerSender(effects.LedgerConfig{Pool: pool, Table: bad})
		require.ErrorContains(t, err, "invalid config", bad)
	}
}
