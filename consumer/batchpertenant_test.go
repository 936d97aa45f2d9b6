package consumer_test

import (
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/internal/sqlaudit"
)

// TestBatchPerTenant: with BatchPerTenant, the messages of three tenants that
// arrive together run as three batches, each claimed with a statement that names
// its tenant and committed on its own; every message commits once. Without it they
// run as one batch, claimed with the statement for several tenants.
func TestBatchPerTenant(t *testing.T) {
	t.Parallel()
	for _, split := range []bool{false, true} {
		t.Run(map[bool]string{false: "mixed", true: "split"}[split], func(t *testing.T) {
			t.Parallel()
			_, b := setup(t, consumer.Transactional)
			pool, log := tracedPool(t, b.schema)
			c, err := consumer.New(consumer.Config{Name: "payments", Pool: pool, Schema: b.schema, Mode: consumer.GroupCommit,
				Tenant: consumer.MetadataKey("tenant"), Batch: consumer.BatchConfig{MaxBatch: 5, MaxWait: 2 * time.Second, Workers: 1, PerTenant: split},
				Registerer: b.reg})
			require.NoError(t, err)
			t.Cleanup(func() { _ = c.Close() })
			h := middlewareFunc(c.Middleware(b.bizHandler(nil)))
			msgs := []*message.Message{tenantMsg("b", "m1"), tenantMsg("a", "m2"), tenantMsg("c", "m3"),
				tenantMsg("a", "m4"), tenantMsg("b", "m5")}
			for _, err := range sendTogether(h, msgs...) {
				require.NoError(t, err)
			}
			require.Equal(t, 5, pgtest.Count(t, b.pool, `SELECT count(*) FROM biz`))
			require.Equal(t, 2, pgtest.Count(t, b.pool, `SELECT count(*) FROM inbox WHERE tenant = 'a'`))
			require.Equal(t, 2, pgtest.Count(t, b.pool, `SELECT count(*) FROM effects WHERE tenant = 'b'`))
			log.mu.Lock()
			var claims []string
			for _, s := range log.sqls {
				if log.isClaim(s) {
					claims = append(claims, s)
				}
			}
			log.mu.Unlock()
			if !split {
				require.Len(t, claims, 1, "one batch")
				require.False(t, sqlaudit.Routable(claims[0]), "the claim of several tenants")
				require.Equal(t, 1, log.count("COMMIT"))
				return
			}
			require.Len(t, claims, 3, "a batch per tenant")
			for _, s := range claims {
				require.True(t, sqlaudit.Routable(s), s)
			}
			require.Equal(t, 3, log.count("COMMIT"), "a transaction per tenant")
			require.Equal(t, 3, log.count("unnest", "effects"), "each batch's effects")
		})
	}
}

// isClaim says whether s is a batch's claim of inbox keys.
func (l *sqlLog) isClaim(s string) bool {
	return containsAll(s, "INSERT INTO", "inbox", "unnest")
}

func containsAll(s string, parts ...string) bool {
	for _, p := range parts {
		if !strings.Contains(s, p) {
			return false
		}
	}
	return true
}
