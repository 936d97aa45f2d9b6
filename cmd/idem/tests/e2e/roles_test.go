package e2e

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/httpidem"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/janitor"
)

// appGrants is what docs/database.md tells users to grant the role their services run
// as, once the schema's owner has run the migrations. Nothing more is needed.
const appGrants = `GRANT USAGE ON SCHEMA %[1]s TO %[2]s;
	GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA %[1]s TO %[2]s`

// TestLeastPrivilegeRole: the migrations run as the schema's owner, and everything
// else runs as a role that has only USAGE on the schema and SELECT, INSERT, UPDATE
// and DELETE on its tables (and on the application's own table): a consumer in each
// mode and with a batch handler, the commit guard of the set-based batch, the
// Dispatcher with its LISTEN, RequeueDead, httpidem in both modes, the janitor's
// advisory lock and deletes, and the operator API (a failure group's release and
// its stored audit row included).
func TestLeastPrivilegeRole(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	owner, schema := pgtest.Setup(t)
	_, err := owner.Exec(ctx, `CREATE TABLE biz (key text PRIMARY KEY)`)
	require.NoError(t, err)
	pool := appRolePool(t, owner, schema)

	// The role cannot change the schema: it is really least-privileged.
	_, err = pool.Exec(ctx, `CREATE TABLE nope (x int)`)
	require.ErrorContains(t, err, "permission denied")

	write := func(ctx context.Context, tx pgx.Tx, m *message.Message) error {
		if _, err := tx.Exec(ctx, `INSERT INTO biz (key) VALUES ($1)`, m.UUID); err != nil {
			return err
		}
		_, err := effects.Enqueue(m.Context(), tx, effects.Effect{Kind: "mail", Key: "receipt:" + m.UUID, Payload: []byte(`{}`)})
		return err
	}
	for _, mode := range []consumer.Mode{consumer.Transactional, consumer.GroupCommit, consumer.Lease} {
		c, err := consumer.New(consumer.Config{Name: "orders-" + mode.String(), Pool: pool, Schema: schema, Mode: mode,
			Batch: batchWait(mode, 50*time.Millisecond), LockTimeout: 2 * time.Second, BusyDelay: time.Millisecond})
		require.NoError(t, err)
		h := c.Middleware(func(m *message.Message) ([]*message.Message, error) {
			if m.UUID == "bad-"+mode.String() {
				return nil, consumer.Permanent(errors.New("refused"))
			}
			return nil, write(m.Context(), consumer.Tx(m.Context()), m)
		})
		for _, id := range []string{mode.String(), mode.String(), "bad-" + mode.String()} {
			_, err := h(message.NewMessage(id, []byte(`{}`)))
			require.NoError(t, err, "%s: %s", mode, id)
		}
		require.NoError(t, c.Close())
	}
	c, err := consumer.New(consumer.Config{Name: "orders-batch", Pool: pool, Schema: schema, Batch: consumer.BatchConfig{MaxWait: 50 * time.Millisecond}})
	require.NoError(t, err)
	hb := c.HandleBatch(func(ctx context.Context, tx pgx.Tx, msgs []*message.Message) error {
		for _, m := range msgs {
			if err := write(ctx, tx, m); err != nil {
				return err
			}
		}
		return nil
	})
	require.NoError(t, hb(message.NewMessage("batch", []byte(`{}`))))
	require.NoError(t, c.Close())
	require.Equal(t, 4, pgtest.Count(t, owner, `SELECT count(*) FROM biz`))

	// httpidem, in a transaction and in lease mode.
	mw, err := httpidem.New(httpidem.Config{Pool: pool, Schema: schema, Unscoped: true})
	require.NoError(t, err)
	created := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if tx := httpidem.Tx(r.Context()); tx != nil {
			if _, err := tx.Exec(r.Context(), `INSERT INTO biz (key) VALUES ($1)`, r.Header.Get("Idempotency-Key")); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "created\n")
	})
	mux := http.NewServeMux()
	mux.Handle("POST /payments", mw.Middleware(created))
	mux.Handle("POST /refunds", mw.Route(httpidem.Route{Lease: true})(created))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	for _, path := range []string{"/payments", "/refunds"} {
		for i := range 2 {
			req, _ := http.NewRequest(http.MethodPost, srv.URL+path, strings.NewReader(`{}`))
			req.Header.Set("Idempotency-Key", "http"+strings.ReplaceAll(path, "/", "-"))
			resp, err := srv.Client().Do(req)
			require.NoError(t, err)
			body, _ := io.ReadAll(resp.Body)
			require.NoError(t, resp.Body.Close())
			require.Equal(t, http.StatusCreated, resp.StatusCode, "%s: %s", path, body)
			require.Equal(t, i == 1, resp.Header.Get("Idempotent-Replayed") == "true", path)
		}
	}

	// The Dispatcher sends every effect, and a dead one is requeued.
	sent := make(chan string, 16)
	d, err := effects.NewDispatcher(effects.Config{Pool: pool, Schema: schema, PollInterval: 50 * time.Millisecond,
		Senders: map[string]effects.Sender{"mail": effects.SenderFunc(func(_ context.Context, e effects.Delivery) error {
			sent <- e.Key
			if e.Key == "receipt:dead" {
				return effects.Permanent(errors.New("no such mailbox"))
			}
			return nil
		})}})
	require.NoError(t, err)
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- d.Run(runCtx) }()
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	_, err = effects.Enqueue(effects.WithScope(ctx, effects.Scope{Schema: schema}), tx, effects.Effect{Kind: "mail", Key: "receipt:dead"})
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	pgtest.WaitFor(t, 20*time.Second, "no effect pending", func() bool {
		return pgtest.Count(t, owner, `SELECT count(*) FROM effects WHERE state = 'pending'`) == 0
	})
	n, err := effectsdb.RequeueDead(ctx, pool, schema, effectsdb.RequeueFilter{Kind: "mail"})
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	pgtest.WaitFor(t, 20*time.Second, "the requeued effect dead again", func() bool {
		return pgtest.Count(t, owner, `SELECT count(*) FROM effects WHERE state = 'dead'`) == 1
	})
	stop()
	require.NoError(t, <-done)
	require.Equal(t, 4, pgtest.Count(t, owner, `SELECT count(*) FROM effects WHERE state = 'done'`), "one receipt per consumer")

	// The operator API reads and acts; the janitor takes its lock and deletes.
	a, err := admin.New(admin.Config{Pool: pool, Schema: schema})
	require.NoError(t, err)
	_, err = a.Stats(ctx)
	require.NoError(t, err)
	_, err = a.ListInbox(ctx, admin.InboxFilter{}, admin.Page{})
	require.NoError(t, err)
	_, err = a.Forget(ctx, inbox.ID{Consumer: "orders-batch", Key: "batch"}, admin.Audit{Who: "test", Why: "least privilege"})
	require.NoError(t, err)
	// Failure groups: listed, one released with its audit row stored (a UUID key:
	// no sequence to grant).
	groups, err := a.ListGroups(ctx, admin.GroupFilter{}, admin.Page{})
	require.NoError(t, err)
	require.Len(t, groups.Rows, 4, "the failed key of each consumer mode, and the dead receipt")
	note := admin.Audit{Who: "test", Why: "least privilege"}
	for _, g := range groups.Rows {
		act := a.ReleaseGroup
		if g.Source == admin.SourceEffects {
			act = a.DiscardGroup
		}
		res, err := act(ctx, admin.GroupAction{ID: g.ID, Through: g.LastSeen, Note: note})
		require.NoError(t, err)
		require.Equal(t, int64(1), res.Rows)
	}
	acts, err := a.ListActions(ctx, admin.ActionFilter{}, admin.Page{})
	require.NoError(t, err)
	require.Len(t, acts.Rows, 4)
	_, err = owner.Exec(ctx, `UPDATE inbox SET expires_at = now() - interval '1 second' WHERE state IN ('completed', 'failed')`)
	require.NoError(t, err)
	j, err := janitor.New(janitor.Config{Pool: pool, Schema: schema})
	require.NoError(t, err)
	st, err := j.RunOnce(ctx)
	require.NoError(t, err)
	require.Positive(t, st.InboxDeleted)
	require.Zero(t, pgtest.Count(t, owner, `SELECT count(*) FROM inbox WHERE state IN ('completed', 'failed')`))
}

// appRolePool makes a login role with appGrants on schema (and DML on its other
// tables), dropped when the test ends, and returns a pool that connects as it.
func appRolePool(t *testing.T, owner *pgxpool.Pool, schema string) *pgxpool.Pool {
	t.Helper()
	ctx := context.Background()
	var super, createRole bool
	require.NoError(t, owner.QueryRow(ctx, `SELECT rolsuper, rolcreaterole FROM pg_roles WHERE rolname = current_user`).Scan(&super, &createRole))
	require.True(t, super || createRole, "TestLeastPrivilegeRole makes a role: the DATABASE_URL role needs CREATEROLE (the default postgres superuser has it)")
	secret := make([]byte, 12)
	_, _ = rand.Read(secret)
	role, password := "idem_app_"+hex.EncodeToString(secret[:6]), hex.EncodeToString(secret[6:])
	roleID, schemaID := pgx.Identifier{role}.Sanitize(), pgx.Identifier{schema}.Sanitize()
	_, err := owner.Exec(ctx, `CREATE ROLE `+roleID+` LOGIN PASSWORD '`+password+`'`)
	require.NoError(t, err)
	t.Cleanup(func() {
		conn, err := pgx.Connect(ctx, pgtest.URL())
		if err != nil {
			t.Errorf("drop role %s: %v", role, err)
			return
		}
		defer func() { _ = conn.Close(ctx) }()
		// The role owns nothing; DROP OWNED also revokes its grants, which
		// DROP ROLE needs gone.
		if _, err := conn.Exec(ctx, `DROP OWNED BY `+roleID); err != nil {
			t.Errorf("drop owned by %s: %v", role, err)
		}
		if _, err := conn.Exec(ctx, `DROP ROLE `+roleID); err != nil {
			t.Errorf("drop role %s: %v", role, err)
		}
	})
	_, err = owner.Exec(ctx, fmt.Sprintf(appGrants, schemaID, roleID))
	require.NoError(t, err)
	cfg := pgtest.PoolConfig(t, schema, pgtest.Options{MaxConns: 6})
	cfg.ConnConfig.User, cfg.ConnConfig.Password = role, password
	pool := pgtest.OpenPool(t, cfg)
	var who string
	require.NoError(t, pool.QueryRow(ctx, `SELECT current_user`).Scan(&who))
	require.Equal(t, role, who)
	return pool
}

// batchWait is Config.Batch with MaxWait d, in the modes that batch (Lease mode
// refuses a Batch).
func batchWait(m consumer.Mode, d time.Duration) consumer.BatchConfig {
	if m == consumer.Lease {
		return consumer.BatchConfig{}
	}
	return consumer.BatchConfig{MaxWait: d}
}
