package consumer_test

// Stored error text and the tenant scope reaching effects, as the consumer sees
// them. Self-contained (their own setup), so that they do not depend on the
// helpers of consumer_test.go.

import (
	"context"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/pgtest"
)

// TestPermanentErrorWithBinaryTextIsRecorded: a handler's permanent error that
// holds a NUL byte and invalid UTF-8 (a quoted binary response body) is recorded,
// escaped, in every mode, and the message is acked. (Before, Postgres refused the
// failed row with 22021: the failure was never recorded and the message was nacked
// again and again.)
func TestPermanentErrorWithBinaryTextIsRecorded(t *testing.T) {
	t.Parallel()
	for _, mode := range []consumer.Mode{consumer.Transactional, consumer.GroupCommit, consumer.Lease} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			pool, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 4})
			c, err := consumer.New(consumer.Config{Name: "payments", Pool: pool, Schema: schema, Mode: mode})
			require.NoError(t, err)
			t.Cleanup(func() { _ = c.Close() })
			h := c.Middleware(func(*message.Message) ([]*message.Message, error) {
				return nil, consumer.Permanent(errors.New("upstream replied \x00\xff\xfe\x89PNG"))
			})
			_, err = h(message.NewMessage("pay-1", []byte(`{}`)))
			require.NoError(t, err, "recorded and acked")
			store, err := inboxdb.NewStore(schema)
			require.NoError(t, err)
			rec, err := store.Get(context.Background(), pool, inboxdb.ID{Consumer: "payments", Key: "pay-1"})
			require.NoError(t, err)
			require.Equal(t, inboxdb.StateFailed, rec.State)
			require.Contains(t, rec.Error, `upstream replied \x00\xff\xfe\x89PNG`)
		})
	}
}

// TestTenantScopedEffects: two tenants' messages that enqueue the same effect key
// make two effects, each with its tenant; neither is the other's duplicate or
// mismatch. (Before, effect keys were global: tenant B's Enqueue of receipt:123
// returned Duplicate, or ErrFingerprintMismatch with another payload, because tenant
// A had it.)
func TestTenantScopedEffects(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 4})
	c, err := consumer.New(consumer.Config{Name: "payments", Pool: pool, Schema: schema,
		Tenant: consumer.MetadataKey("tenant")})
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	results, errs := map[string]effects.Result{}, map[string]error{}
	h := c.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		res, err := effects.Enqueue(ctx, consumer.Tx(ctx), effects.Effect{Kind: "email", Key: "receipt:123", Payload: msg.Payload})
		results[msg.Metadata.Get("tenant")], errs[msg.Metadata.Get("tenant")] = res, err
		return nil, err
	})
	for _, tenant := range []string{"acme", "globex"} {
		msg := message.NewMessage("pay-123", []byte(`{"to":"`+tenant+`"}`))
		msg.Metadata.Set("tenant", tenant)
		_, err := h(msg)
		require.NoError(t, err, tenant)
		require.NoError(t, errs[tenant], "%s's Enqueue", tenant)
		require.False(t, results[tenant].Duplicate, "%s's effect is not another tenant's duplicate", tenant)
	}
	rows, err := pool.Query(context.Background(), `SELECT tenant, source_tenant, payload FROM effects WHERE key = 'receipt:123' ORDER BY tenant`)
	require.NoError(t, err)
	defer rows.Close()
	var got []string
	for rows.Next() {
		var tenant, source string
		var payload []byte
		require.NoError(t, rows.Scan(&tenant, &source, &payload))
		require.Equal(t, tenant, source)
		got = append(got, tenant+" "+string(payload))
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []string{`acme {"to":"acme"}`, `globex {"to":"globex"}`}, got)
}
