package consumer_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/pgtest"
)

// A message without a tenant over a shard map is refused with ErrTenantMissing
// (tenant_invalid, permanent, httpidem's code for the same request): nothing is
// claimed on any shard, and the handler does not run. With DefaultTenant it runs
// on the default tenant's shard, under that tenant. In each mode, and with a batch
// handler.
func TestShardsRefuseMessageWithoutTenant(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{"transactional", "group-commit", "batch-handler"} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			m := pgtest.Shards(t)
			sb := newShardBiz(t, m)
			var ran atomic.Int64
			write := func(ctx context.Context, tx pgx.Tx, msgs []*message.Message) error {
				for _, msg := range msgs {
					ran.Add(1)
					if _, err := tx.Exec(ctx, `INSERT INTO biz (tenant, key) VALUES ($1, $2)`, msg.Metadata.Get("tenant"), msg.UUID); err != nil {
						return err
					}
				}
				return nil
			}
			handler := func(c *consumer.Consumer) func(*message.Message) error {
				if kind == "batch-handler" {
					return c.HandleBatch(write)
				}
				mw := c.Middleware(func(msg *message.Message) ([]*message.Message, error) {
					return nil, write(msg.Context(), consumer.Tx(msg.Context()), []*message.Message{msg})
				})
				return func(msg *message.Message) error { _, err := mw(msg); return err }
			}
			mode := consumer.Transactional
			if kind == "group-commit" {
				mode = consumer.GroupCommit
			}
			h := handler(shardedConsumer(t, m, mode))

			for i := range 12 {
				require.NoError(t, h(tenantMsg(fmt.Sprintf("tenant-%d", i), fmt.Sprintf("k-%d", i))))
			}
			for _, msg := range []*message.Message{tenantMsg("", "no-tenant"), message.NewMessage("no-field", []byte(`{}`))} {
				err := h(msg)
				require.ErrorIs(t, err, consumer.ErrTenantMissing, msg.UUID)
				require.Equal(t, "tenant_invalid", inbox.Code(err))
				require.True(t, consumer.IsPermanent(err))
				require.Empty(t, sb.rows(t, "inbox", msg.UUID), "%s: claimed on a shard", msg.UUID)
				require.Empty(t, sb.rows(t, "biz", msg.UUID), msg.UUID)
			}
			require.EqualValues(t, 12, ran.Load(), "the handler ran for a message without a tenant")
			used := map[string]bool{}
			for i := range 12 {
				want := sb.want(t, fmt.Sprintf("tenant-%d", i))
				used[want] = true
				require.Equal(t, map[string]int{want: 1}, sb.rows(t, "biz", fmt.Sprintf("k-%d", i)))
			}
			require.Len(t, used, len(m.Shards), "the tenants spread over every shard")

			// With a DefaultTenant the message runs on its shard, under it.
			hd := handler(shardedConsumer(t, m, mode, func(cfg *consumer.Config) {
				cfg.Name, cfg.DefaultTenant = "orders-default", "acme"
			}))
			require.NoError(t, hd(tenantMsg("", "no-tenant")))
			want := sb.want(t, "acme")
			require.Equal(t, map[string]int{want: 1}, sb.rows(t, "inbox", "no-tenant"))
			require.Equal(t, map[string]int{want: 1}, sb.rows(t, "biz", "no-tenant"))
			for _, s := range m.Shards {
				if s.Name == want {
					require.Equal(t, 1, pgtest.ShardCount(t, s, `SELECT count(*) FROM inbox WHERE key = 'no-tenant' AND tenant = 'acme'`))
				}
			}
		})
	}
}

// DefaultTenant is checked like a tenant, and needs Tenant.
func TestDefaultTenantValidated(t *testing.T) {
	t.Parallel()
	m := pgtest.Shards(t)
	base := consumer.Config{Name: "orders", Shards: m, Tenant: consumer.MetadataKey("tenant")}
	bad := base
	bad.DefaultTenant = "a\x00b"
	require.ErrorIs(t, bad.Validate(), inbox.ErrTenantInvalid)
	_, err := consumer.New(bad)
	require.ErrorIs(t, err, inbox.ErrTenantInvalid)
	noFunc := consumer.Config{Name: "orders", Pool: m.Shards[0].Pool, DefaultTenant: "acme"}
	require.ErrorIs(t, noFunc.Validate(), consumer.ErrInvalidConfig)
	good := base
	good.DefaultTenant = "acme"
	require.NoError(t, good.Validate())
}
