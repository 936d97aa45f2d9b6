package httpidem_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/httpidem"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/shard"
)

// Each request is claimed, run and committed on its tenant's shard; a retry with
// the same key is replayed from there; a route that fails is a shard_route problem.
// The tenant is read once a request. Each shard's series carry its name (the shards share a schema name here): its
// committed and replayed answers are its own inbox rows.
func TestShardedRequestsRunOnTheirTenantsShard(t *testing.T) {
	t.Parallel()
	m := pgtest.Shards(t)
	ports := map[int]string{}
	for _, s := range m.Shards {
		_, err := s.Pool.Exec(context.Background(), `CREATE TABLE payments (id bigserial PRIMARY KEY, tenant text NOT NULL, shard_port int NOT NULL)`)
		require.NoError(t, err)
		ports[int(s.Pool.Config().ConnConfig.Port)] = s.Name
	}
	hash := &shard.Map{Shards: m.Shards}
	m.Route = func(tenant string) (string, error) {
		if tenant == "nowhere" {
			return "", errors.New("no directory entry")
		}
		s, err := hash.Pick(tenant)
		return s.Name, err
	}
	reg := prometheus.NewRegistry()
	var tenantCalls atomic.Int64
	mw, err := httpidem.New(httpidem.Config{Shards: m, Registerer: reg, Tenant: func(r *http.Request) (string, error) {
		tenantCalls.Add(1)
		return r.Header.Get("X-Tenant"), nil
	}})
	require.NoError(t, err)
	mux := http.NewServeMux()
	mux.Handle("POST /payments", mw.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		tx := httpidem.Tx(ctx)
		var id, port int
		err := tx.QueryRow(ctx, `INSERT INTO payments (tenant, shard_port) VALUES ($1, inet_server_port()) RETURNING id, shard_port`,
			r.Header.Get("X-Tenant")).Scan(&id, &port)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"shard":%q}`, ports[port])
	})))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)

	used := map[string]bool{}
	for i := range 18 {
		tenant := fmt.Sprintf("tenant-%d", i)
		want, err := m.Pick(tenant)
		require.NoError(t, err)
		used[want.Name] = true
		for try := range 2 {
			a, err := postTo(context.Background(), srv.Client(), srv.URL, "/payments", "k-"+tenant, `{}`, "X-Tenant", tenant)
			require.NoError(t, err)
			require.Equal(t, http.StatusCreated, a.Status, "%s", a)
			require.JSONEq(t, fmt.Sprintf(`{"shard":%q}`, want.Name), string(a.Body))
			require.Equal(t, try == 1, a.Replayed)
		}
		for _, s := range m.Shards {
			n := pgtest.ShardCount(t, s, `SELECT count(*) FROM payments WHERE tenant = $1`, tenant)
			k := pgtest.ShardCount(t, s, `SELECT count(*) FROM inbox WHERE tenant = $1`, tenant)
			if s.Name == want.Name {
				require.Equal(t, 1, n, "%s's payment once, on %s", tenant, s.Name)
				require.Equal(t, 1, k)
			} else {
				require.Zero(t, n+k, "nothing of %s on %s", tenant, s.Name)
			}
		}
	}
	require.Len(t, used, len(m.Shards))
	// The tenant is read once a request: it picks the shard and scopes the key.
	require.EqualValues(t, 18*2, tenantCalls.Load())
	answers := func(shard, outcome string) float64 {
		mfs, err := reg.Gather()
		require.NoError(t, err)
		var sum float64
		for _, mf := range mfs {
			for _, one := range mf.GetMetric() {
				l := map[string]string{}
				for _, p := range one.GetLabel() {
					l[p.GetName()] = p.GetValue()
				}
				if mf.GetName() == "idem_http_requests_total" && l["shard"] == shard && l["outcome"] == outcome {
					sum += one.GetCounter().GetValue()
				}
			}
		}
		return sum
	}
	for _, s := range m.Shards {
		n := pgtest.ShardCount(t, s, `SELECT count(*) FROM inbox`)
		require.EqualValues(t, n, answers(s.Name, httpidem.OutcomeCommitted), "committed on %s", s.Name)
		require.EqualValues(t, n, answers(s.Name, httpidem.OutcomeReplayed), "replayed on %s", s.Name)
	}

	a, err := postTo(context.Background(), srv.Client(), srv.URL, "/payments", "k-x", `{}`, "X-Tenant", "nowhere")
	require.NoError(t, err)
	problem(t, a, http.StatusInternalServerError, httpidem.CodeShardRoute)
	a, err = postTo(context.Background(), srv.Client(), srv.URL, "/payments", "k-y", `{}`, "X-Tenant", "")
	require.NoError(t, err)
	problem(t, a, http.StatusBadRequest, httpidem.CodeTenantInvalid)
}
