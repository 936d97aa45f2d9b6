package sqlaudit_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/httpidem"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/internal/sqlaudit"
	"github.com/idemkit/idem/internal/txmark"
	"github.com/idemkit/idem/janitor"
)

// allowList are the statements idem sends that do not name one tenant, each with
// why. A distributed Postgres that routes by tenant runs them on every node (or,
// for those that touch no table, anywhere). Keep it short; each pattern matches
// one statement, anchored at both ends. Rare entries may not run in a given
// workload (a race decides whether they are needed).
func allowList(schema string) []allowed {
	t := regexp.QuoteMeta(pgx.Identifier{schema}.Sanitize()) + `\.`
	inbox, effectsT := t+`"?inbox"?`, t+`"?effects"?`
	return []allowed{
		// A group-commit or batch-handler batch that holds several tenants' messages:
		// one claim for all of them (a one-tenant batch uses the forms that name it).
		{why: "mixed-tenant batch: inbox claim", multi: true, re: `^WITH ins AS \( INSERT INTO ` + inbox + ` .* WHERE i\.consumer = k\.consumer AND i\.tenant = k\.tenant AND i\.key = k\.key OFFSET 0 \) i ON true WHERE NOT k\.claimed$`},
		{why: "mixed-tenant batch: inbox read of keys a concurrent claimer committed", multi: true, rare: true, re: `^SELECT u\.ord::int, .* FROM ` + inbox + ` i WHERE i\.consumer = u\.consumer AND i\.tenant = u\.tenant AND i\.key = u\.key OFFSET 0 \) i$`},
		{why: "mixed-tenant batch: delete of its expired keys", multi: true, re: `^DELETE FROM ` + inbox + ` i USING unnest\(\$1::text\[\], \$2::text\[\], \$3::text\[\]\) AS u\(consumer, tenant, key\) WHERE i\.consumer = u\.consumer AND i\.tenant = u\.tenant AND i\.key = u\.key .*$`},
		{why: "mixed-tenant batch: its effects", multi: true, re: `^WITH ins AS \( INSERT INTO ` + effectsT + ` \(tenant, kind, .* unnest\(\$11::text\[\]\) AS trace_context\) u ON CONFLICT .*$`},
		{why: "mixed-tenant batch: the effects a concurrent writer committed", multi: true, rare: true, re: `^SELECT coalesce\(array_agg\(e\.tenant\), '\{\}'\), .* WHERE e\.tenant = u\.tenant AND .*$`},
		// The commit guard row (a table without tenants, one row per transaction, its
		// insert goes with the batch's transaction) and the mark's check before COMMIT.
		{why: "commit guard", re: `^INSERT INTO ` + t + `"?commit_guard"? DEFAULT VALUES$`},
		{why: "commit check of the transaction's mark", re: `^` + regexp.QuoteMeta(sqlaudit.Normalize(txmark.Check)) + `; (SET LOCAL idem\.commit = 'on'; )?COMMIT$`},
		{why: "rollback's check of the transaction's mark", re: `^SELECT ` + regexp.QuoteMeta(txmark.Marked) + `$`},
		// Whether the schema is distributed by Citus (internal/citusmode), asked once
		// by each consumer, httpidem middleware and janitor: catalogs, no table of
		// idem's. The second question is asked only where Citus is installed.
		{why: "Citus mode: is the extension installed", re: `^SELECT to_regclass\('pg_catalog\.pg_dist_partition'\) IS NOT NULL$`},
		{why: "Citus mode: is the inbox distributed", rare: true, re: `^SELECT EXISTS \(SELECT 1 FROM pg_catalog\.pg_dist_partition WHERE logicalrelid = to_regclass\(\$1\)\)$`},
		// httpidem's transaction id, read at BEGIN and after a cut connection: no table.
		{why: "httpidem: the transaction's id", re: `^SELECT pg_current_xact_id\(\)::text$`},
		{why: "httpidem: the transaction's status after a cut", rare: true, re: `^SELECT pg_xact_status\(\$1::xid8\)$`},
		// The Dispatcher without Config.Tenant serves every tenant: its claim and the
		// outcomes of a batch that holds several tenants' effects.
		{why: "unfiltered Dispatcher: claim", multi: true, re: `^WITH want AS \( .*next_attempt_at <= now\(\) ORDER BY .* WHERE e\.ctid = due\.row RETURNING .*$`},
		{why: "mixed-tenant outcome batch", multi: true, re: `^UPDATE ` + effectsT + ` e SET .* WHERE e\.tenant = d\.tenant AND .* RETURNING d\.i$`},
		{why: "mixed-tenant outcome batch, retried", multi: true, rare: true, re: `^WITH d AS \( SELECT \* FROM unnest.* ON e\.tenant = d\.tenant AND .*$`},
		// consumer.New, effects.NewDispatcher and httpidem.New check the schema once:
		// the catalog only, no idem table.
		{why: "start-up check of the schema's migration level", re: `^SELECT EXISTS \(SELECT 1 FROM pg_catalog\.pg_namespace WHERE nspname = \$1\), ARRAY\[EXISTS \(SELECT 1 FROM pg_catalog\..*\]$`},
		// Wake-ups and the pending gauge: LISTEN/NOTIFY name a channel, the gauge
		// counts every tenant's pending effects.
		{why: "LISTEN for new effects", re: `^LISTEN idem_effects$`},
		{why: "NOTIFY of released claims", rare: true, re: `^SELECT pg_notify\('idem_effects', \$1\)$`},
		{why: "pending effects gauge", re: `^SELECT kind, count\(\*\) FROM ` + effectsT + ` WHERE state = 'pending' GROUP BY kind$`},
		// The janitor: retention deletes across tenants, under an advisory lock.
		{why: "janitor: lock", re: `^SELECT pg_try_advisory_lock\(hashtextextended\('idem\.janitor:' \|\| \$1, 0\)\)$`},
		{why: "janitor: unlock", re: `^SELECT pg_advisory_unlock\(hashtextextended\('idem\.janitor:' \|\| \$1, 0\)\)$`},
		{why: "janitor: expired inbox keys", re: `^DELETE FROM ` + inbox + ` WHERE ctid = ANY \(ARRAY\( SELECT ctid FROM ` + inbox + ` WHERE state IN \('completed', 'failed'\) AND expires_at < now\(\) .*$`},
		{why: "janitor: old done and discarded effects", re: `^DELETE FROM ` + effectsT + ` WHERE ctid = ANY \(ARRAY\( SELECT ctid FROM ` + effectsT + ` WHERE state = '(done|discarded)' .*$`},
	}
}

type allowed struct {
	why, re string
	rare    bool // may not run in a given workload
	multi   bool // only for work that spans tenants: a one-tenant batch or Dispatcher never needs it
}

// oneTenant is list without the entries for work that spans tenants.
func oneTenant(list []allowed) []allowed {
	var out []allowed
	for _, a := range list {
		if !a.multi {
			a.rare = true
			out = append(out, a)
		}
	}
	return out
}

// requireOneTenant fails t unless every statement of stmts, sent by work of one
// tenant, names it or is allowed for any work.
func requireOneTenant(t *testing.T, schema, what string, stmts []string) {
	t.Helper()
	require.NotEmpty(t, stmts, what)
	flagged, _ := check(stmts, oneTenant(allowList(schema)))
	require.Empty(t, flagged, "%s sent statements that do not name its tenant:\n%s", what, strings.Join(flagged, "\n\n"))
}

// statementLog records every statement sent through a pool: queries, the
// statements of pipelined batches, and copies (as "COPY table").
type statementLog struct {
	mu   sync.Mutex
	sqls []string
}

func (l *statementLog) add(sql string) {
	l.mu.Lock()
	l.sqls = append(l.sqls, sql)
	l.mu.Unlock()
}

func (l *statementLog) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	l.add(d.SQL)
	return ctx
}
func (l *statementLog) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (l *statementLog) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}
func (l *statementLog) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	l.add(d.SQL)
}
func (l *statementLog) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}
func (l *statementLog) TraceCopyFromStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceCopyFromStartData) context.Context {
	l.add("COPY " + d.TableName.Sanitize())
	return ctx
}
func (l *statementLog) TraceCopyFromEnd(context.Context, *pgx.Conn, pgx.TraceCopyFromEndData) {}

func (l *statementLog) all() []string { return l.since(0) }

// mark is where the log is now, for since.
func (l *statementLog) mark() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.sqls)
}

// since returns the statements logged after mark.
func (l *statementLog) since(mark int) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.sqls[mark:])
}

// TestEveryStatementNamesOneTenant is the statement audit: every statement idem's
// consumer (per message, group commit, batch handler, lease; batches split by
// tenant or not), Dispatcher (for one
// tenant and for all), httpidem (transactional and lease: a first request, a
// replay, a mismatch, a failure) and janitor send, captured by a pgx tracer on
// their pool, names one tenant (sqlaudit.Routable), is transaction control, or is
// on the allow-list with its reason. A new statement that names no tenant fails
// it until it does, or until it is allowed here with a reason. The operator API
// (admin) and migrate are left out: an operator's reads and actions span
// tenants, and migrations are DDL, by nature.
func TestEveryStatementNamesOneTenant(t *testing.T) {
	t.Parallel()
	db, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 2}) // the test's own statements
	ctx := context.Background()
	_, err := db.Exec(ctx, `CREATE TABLE biz (id bigserial PRIMARY KEY, tenant text NOT NULL, key text NOT NULL)`)
	require.NoError(t, err)
	log := &statementLog{}
	cfg := pgtest.PoolConfig(t, schema, pgtest.Options{MaxConns: 6})
	cfg.ConnConfig.Tracer = log
	pool := pgtest.OpenPool(t, cfg)

	for _, mode := range []consumer.Mode{consumer.Transactional, consumer.GroupCommit, consumer.Lease} {
		runConsumer(t, db, pool, log, schema, mode, false, false)
	}
	runConsumer(t, db, pool, log, schema, consumer.GroupCommit, true, false)
	runConsumer(t, db, pool, log, schema, consumer.GroupCommit, false, true)
	runConsumer(t, db, pool, log, schema, consumer.GroupCommit, true, true)
	runHTTP(t, pool, schema)
	runDispatchers(t, db, pool, log, schema)
	// Expire what there is, for the janitor to delete.
	_, err = db.Exec(ctx, `UPDATE inbox SET expires_at = now() - interval '1 hour'`)
	require.NoError(t, err)
	_, err = db.Exec(ctx, `UPDATE effects SET done_at = now() - interval '30 days' WHERE state = 'done'`)
	require.NoError(t, err)
	j, err := janitor.New(janitor.Config{Pool: pool, Schema: schema})
	require.NoError(t, err)
	st, err := j.RunOnce(ctx)
	require.NoError(t, err)
	require.Positive(t, st.InboxDeleted)

	stmts := log.all()
	require.Greater(t, len(stmts), 100)
	flagged, unused := check(stmts, allowList(schema))
	require.Empty(t, flagged, "statements that name no tenant and are not on the allow-list:\n%s", strings.Join(flagged, "\n\n"))
	require.Empty(t, unused, "allow-list entries that matched no statement: remove them, or drive what sends them")

	// Citus's rules (sqlaudit.CitusRefusals): no statement sent here may be one
	// that Citus refuses, unless it is on citusPending, with why.
	refused, unusedCitus := checkCitus(stmts, citusPending(schema))
	require.Empty(t, refused, "statements that Citus refuses:\n%s", strings.Join(refused, "\n\n"))
	require.Empty(t, unusedCitus, "citusPending entries that matched no refused statement: remove them")
}

// citusPending are the statements idem sends on plain Postgres that Citus
// refuses (sqlaudit.CitusRefusals), each with why it may: a statement that has
// a Citus form of its own, sent in Citus mode instead, or work not yet done.
func citusPending(schema string) []allowed {
	t := regexp.QuoteMeta(pgx.Identifier{schema}.Sanitize()) + `\.`
	inbox, effectsT := t+`"?inbox"?`, t+`"?effects"?`
	return []allowed{
		// The janitor's deletes lock rows across tenants (SKIP LOCKED); on Citus it
		// deletes by primary key instead (TestCitusJanitorDeletesOnlyWhatRetentionLetsGo,
		// and TestCitusFormsAreTaken below).
		{why: "janitor: plain Postgres's inbox delete", re: `^DELETE FROM ` + inbox + ` WHERE ctid = ANY .*FOR UPDATE SKIP LOCKED.*$`},
		{why: "janitor: plain Postgres's effects deletes", re: `^DELETE FROM ` + effectsT + ` WHERE ctid = ANY .*FOR UPDATE SKIP LOCKED.*$`},
		// The Dispatcher's plan settings ask for generic plans, which Citus cannot
		// make of a parameterized statement; on Citus it sends its settings
		// without it (citusSettings, TestCitusDispatcherForOneTenant). The claim of
		// a Dispatcher without a Tenant locks rows across tenants; on Citus it
		// finds the tenants with due effects first and claims each with the
		// one-tenant claim (claimEachTenant, TestCitusDispatcherDrainsEveryTenant).
		{why: "Dispatcher: plain Postgres's plan settings", re: `^SET LOCAL plan_cache_mode = force_generic_plan$`},
		{why: "Dispatcher without a Tenant: plain Postgres's claim", re: `^WITH want AS \( .* RETURNING .*$`},
	}
}

// checkCitus returns each statement of stmts that Citus refuses and no entry of
// list matches (with Citus's errors), and the entries that matched no refused
// statement (rare ones excepted).
func checkCitus(stmts []string, list []allowed) (refused, unused []string) {
	used := make([]bool, len(list))
	seen := map[string]bool{}
	for _, sql := range stmts {
		s := sqlaudit.Normalize(sql)
		errs := sqlaudit.CitusRefusals(s)
		if seen[s] || len(errs) == 0 {
			continue
		}
		seen[s] = true
		ok := false
		for i, a := range list {
			if regexp.MustCompile(a.re).MatchString(s) {
				used[i], ok = true, true
			}
		}
		if !ok {
			refused = append(refused, strings.Join(errs, "; ")+":\n"+s)
		}
	}
	for i, a := range list {
		if !used[i] && !a.rare {
			unused = append(unused, a.why)
		}
	}
	return refused, unused
}

// The statements idem sends in Citus mode in place of ones Citus refuses break
// none of Citus's rules.
func TestCitusFormsAreTaken(t *testing.T) {
	t.Parallel()
	q := inboxdb.New("idem")
	for name, sql := range map[string]string{
		"inboxdb.DeleteExpiredByKey":          q.DeleteExpiredByKey,
		"inboxdb.Lease":                       q.Lease,
		"inboxdb.SaveResponseOrFail":          q.SaveResponseOrFail,
		"inboxdb.CompleteLeaseResponseOrFail": q.CompleteLeaseResponseOrFail,
		"inboxdb.ClaimBatchOneTenant":         q.ClaimBatchOneTenant,
	} {
		require.Empty(t, sqlaudit.CitusRefusals(sql), name)
	}
}

// check is sqlaudit.Check with the test's allow-list; rare entries may go unused.
func check(stmts []string, list []allowed) (flagged, unused []string) {
	allow := make([]sqlaudit.Allowed, len(list))
	rare := map[string]bool{}
	for i, a := range list {
		allow[i] = sqlaudit.Allowed{Why: a.why, Match: regexp.MustCompile(a.re)}
		rare[a.why] = a.rare
	}
	flagged, unusedAll := sqlaudit.Check(stmts, allow)
	for _, why := range unusedAll {
		if !rare[why] {
			unused = append(unused, why)
		}
	}
	return flagged, unused
}

func msg(tenant, id string) *message.Message {
	m := message.NewMessage(tenant+"-"+id, []byte(`{}`))
	m.Metadata.Set("tenant", tenant)
	return m
}

// sendTogether hands msgs to h at once, so that they form one batch (the
// consumers' MaxBatch is 3, and each call sends 3).
func sendTogether(t *testing.T, h func(*message.Message) error, msgs ...*message.Message) {
	t.Helper()
	var wg sync.WaitGroup
	for _, m := range msgs {
		wg.Go(func() { _ = h(m) }) // a failure is recorded or nacked; the rows are not what this test checks
	}
	wg.Wait()
}

// runConsumer drives a consumer in mode (with a batch handler if batch, with
// Batch.PerTenant if split): a one-tenant batch, a mixed one, both again after
// their keys expired, and the one-tenant batch once more (duplicates). Each batch
// holds a message whose handler fails permanently. A one-tenant batch, and with
// split a mixed one too, must send only statements that name the tenant.
func runConsumer(t *testing.T, db, pool *pgxpool.Pool, log *statementLog, schema string, mode consumer.Mode, batch, split bool) {
	ctx := context.Background()
	name := fmt.Sprintf("c-%s-%v-%v", mode, batch, split)
	cfg := consumer.Config{Name: name, Pool: pool, Schema: schema, Mode: mode, Tenant: consumer.MetadataKey("tenant")}
	if mode != consumer.Lease {
		cfg.Batch = consumer.BatchConfig{MaxBatch: 3, MaxWait: 2 * time.Second, Workers: 1, PerTenant: split}
	}
	c, err := consumer.New(cfg)
	require.NoError(t, err)
	defer func() { require.NoError(t, c.Close()) }()
	write := func(ctx context.Context, tx pgx.Tx, m *message.Message) error {
		tenant := m.Metadata.Get("tenant")
		if _, err := tx.Exec(ctx, `INSERT INTO biz (tenant, key) VALUES ($1, $2)`, tenant, m.UUID); err != nil {
			return err
		}
		_, err := effects.Enqueue(m.Context(), tx, effects.Effect{Kind: "email", Key: name + ":" + m.UUID, Payload: []byte(`{}`)})
		return err
	}
	var h func(*message.Message) error
	if batch {
		bh := c.HandleBatch(func(ctx context.Context, tx pgx.Tx, msgs []*message.Message) error {
			var errs []error
			for _, m := range msgs {
				if strings.HasSuffix(m.UUID, "-bad") {
					errs = append(errs, consumer.ForMessage(m, consumer.Permanent(errors.New("bad"))))
					continue
				}
				if err := write(ctx, tx, m); err != nil {
					return err
				}
			}
			return errors.Join(errs...)
		})
		h = func(m *message.Message) error { return bh(m) }
	} else {
		mw := c.Middleware(func(m *message.Message) ([]*message.Message, error) {
			if strings.HasSuffix(m.UUID, "-bad") {
				return nil, consumer.Permanent(errors.New("bad"))
			}
			return nil, write(m.Context(), consumer.Tx(m.Context()), m)
		})
		h = func(m *message.Message) error { _, err := mw(m); return err }
	}
	one := func() []*message.Message { return []*message.Message{msg("a", "1"), msg("a", "2"), msg("a", "bad")} }
	mixed := func() []*message.Message { return []*message.Message{msg("a", "3"), msg("b", "1"), msg("b", "bad")} }
	sendOne := func(what string) {
		at := log.mark()
		sendTogether(t, h, one()...)
		requireOneTenant(t, schema, name+": "+what, log.since(at))
	}
	sendMixed := func(what string) {
		at := log.mark()
		sendTogether(t, h, mixed()...)
		if split {
			requireOneTenant(t, schema, name+": "+what+", split by tenant", log.since(at))
		}
	}
	sendOne("a one-tenant batch")
	sendMixed("a mixed batch")
	_, err = db.Exec(ctx, `UPDATE inbox SET expires_at = now() - interval '1 hour' WHERE consumer = $1`, name)
	require.NoError(t, err)
	sendOne("a one-tenant batch of expired keys")
	sendMixed("a mixed batch of expired keys")
	sendOne("a one-tenant batch of duplicates")
	require.Equal(t, 6, pgtest.Count(t, db, `SELECT count(*) FROM inbox WHERE consumer = $1`, name))
}

// runHTTP drives httpidem in both modes: a request, its replay, the same key with
// another body, and a failing request and its replay, for two tenants.
func runHTTP(t *testing.T, pool *pgxpool.Pool, schema string) {
	m, err := httpidem.New(httpidem.Config{Pool: pool, Schema: schema,
		Tenant: func(r *http.Request) (string, error) { return r.Header.Get("X-Tenant"), nil }})
	require.NoError(t, err)
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/fail" {
			http.Error(w, "no", http.StatusUnprocessableEntity)
			return
		}
		tx := httpidem.Tx(r.Context())
		if _, err := tx.Exec(r.Context(), `INSERT INTO biz (tenant, key) VALUES ($1, $2)`, r.Header.Get("X-Tenant"), r.Header.Get("Idempotency-Key")); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	for _, lease := range []bool{false, true} {
		h := m.Route(httpidem.Route{Operation: fmt.Sprintf("pay-%v", lease), Lease: lease})(handler)
		do := func(tenant, path, key, body string) int {
			r := httptest.NewRequest(http.MethodPost, path, strings.NewReader(body))
			r.Header.Set("X-Tenant", tenant)
			r.Header.Set("Idempotency-Key", key)
			w := httptest.NewRecorder()
			h.ServeHTTP(w, r)
			return w.Code
		}
		for _, tenant := range []string{"a", "b"} {
			require.Equal(t, http.StatusCreated, do(tenant, "/pay", "k1", `{"n":1}`))
			require.Equal(t, http.StatusCreated, do(tenant, "/pay", "k1", `{"n":1}`), "replay")
			require.Equal(t, http.StatusUnprocessableEntity, do(tenant, "/pay", "k1", `{"n":2}`), "mismatch")
			require.Equal(t, http.StatusUnprocessableEntity, do(tenant, "/fail", "k2", `{}`))
			require.Equal(t, http.StatusUnprocessableEntity, do(tenant, "/fail", "k2", `{}`), "replay of the failure")
		}
	}
}

// runDispatchers enqueues effects that succeed, fail once and fail for good for
// two tenants, sends tenant a's with a Dispatcher for a, then the rest with one
// for every tenant.
func runDispatchers(t *testing.T, db, pool *pgxpool.Pool, log *statementLog, schema string) {
	ctx := context.Background()
	enqueue := func(keys ...string) {
		for _, tenant := range []string{"a", "b"} {
			for _, key := range keys {
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					_, err := effects.Enqueue(effects.WithScope(ctx, effects.Scope{Schema: schema, Tenant: tenant}), tx,
						effects.Effect{Kind: "email", Key: key, Payload: []byte(`{}`)})
					return err
				})
				require.NoError(t, err)
			}
		}
	}
	enqueue("ok", "flaky", "doomed")
	// The 40 effects of the unfiltered run's two tenants are sent together, and
	// answered at once, so that their outcomes wait for the recorder together.
	var started atomic.Int32
	send := effects.SenderFunc(func(ctx context.Context, d effects.Delivery) error {
		if strings.HasPrefix(d.Key, "n") {
			started.Add(1)
			deadline := time.Now().Add(5 * time.Second)
			for started.Load() < 40 && time.Now().Before(deadline) && ctx.Err() == nil {
				time.Sleep(time.Millisecond)
			}
		}
		switch {
		case d.Key == "flaky" && d.Attempt == 1:
			return errors.New("again")
		case d.Key == "doomed":
			return effects.Permanent(errors.New("never"))
		}
		return nil
	})
	settled := func(tenant string) func() bool {
		return func() bool {
			return pgtest.Count(t, db, `SELECT count(*) FROM effects WHERE ($1 = '' OR tenant = $1) AND state = 'pending'`, tenant) == 0
		}
	}
	for _, tenant := range []string{"a", ""} {
		if tenant == "" {
			// Both tenants' effects due together, for outcome batches that mix them.
			var keys []string
			for i := range 20 {
				keys = append(keys, fmt.Sprint("n", i))
			}
			enqueue(keys...)
		}
		d, err := effects.NewDispatcher(effects.Config{Pool: pool, Schema: schema, Tenant: tenant,
			Senders: map[string]effects.Sender{"email": send}, PollInterval: 20 * time.Millisecond,
			Concurrency: map[string]int{"email": 64},
			Backoff:     effects.Backoff{Initial: 10 * time.Millisecond, Max: 20 * time.Millisecond},
			Registerer:  prometheus.NewRegistry(), PendingRefresh: 10 * time.Millisecond})
		require.NoError(t, err)
		at := log.mark()
		runCtx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- d.Run(runCtx) }()
		pgtest.WaitFor(t, 30*time.Second, "tenant "+tenant+"'s effects settled", settled(tenant))
		cancel()
		require.NoError(t, <-done)
		if tenant != "" {
			requireOneTenant(t, schema, "the Dispatcher for tenant "+tenant, log.since(at))
		}
	}
	require.Equal(t, 2, pgtest.Count(t, db, `SELECT count(*) FROM effects WHERE key = 'doomed' AND state = 'dead'`))
}

// TestAdminStatementsCitusTakes is the audit of the operator API against Citus's
// rules: every statement admin sends for each of its reads and actions (stats,
// activity, lists, inspections, find, failure groups with their backfill,
// retry, discard and release, the audit trail, requeues, forget, the failure
// metrics), captured on plain Postgres, breaks none of the rules
// sqlaudit.CitusRefusals knows, unless it is on adminCitusPending, with why. It
// does not ask for one tenant: an operator's reads and actions span tenants.
func TestAdminStatementsCitusTakes(t *testing.T) {
	t.Parallel()
	db, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 2})
	ctx := context.Background()
	log := &statementLog{}
	cfg := pgtest.PoolConfig(t, schema, pgtest.Options{MaxConns: 2})
	cfg.ConnConfig.Tracer = log
	pool := pgtest.OpenPool(t, cfg)
	// Failures without their groups (as before migration 006): the lists group
	// them first.
	for _, q := range []string{
		`INSERT INTO inbox (consumer, tenant, key, fingerprint, state, error_code, error, completed_at, expires_at)
			SELECT 'orders', 't' || i % 2, 'f' || i, '\x01', 'failed', 'bad', 'order ' || i || ' is bad', now(), now() + interval '1 day'
			FROM generate_series(1, 4) i`,
		`INSERT INTO effects (tenant, kind, key, fingerprint, state, error_code, last_error, next_attempt_at, payload)
			SELECT 't' || i % 2, 'email', 'd' || i, '\x01', 'dead', 'rejected', 'mail ' || i || ' rejected', now(), '{}'
			FROM generate_series(1, 6) i`,
	} {
		_, err := db.Exec(ctx, q)
		require.NoError(t, err)
	}
	reg := prometheus.NewRegistry()
	a, err := admin.New(admin.Config{Pool: pool, Schema: schema, Registerer: reg})
	require.NoError(t, err)
	_, err = reg.Gather()
	require.NoError(t, err)
	_, err = a.Stats(ctx)
	require.NoError(t, err)
	_, err = a.Activity(ctx, time.Hour)
	require.NoError(t, err)
	_, err = a.ListInbox(ctx, admin.InboxFilter{State: "failed"}, admin.Page{Limit: 1})
	require.NoError(t, err)
	_, err = a.ListEffects(ctx, admin.EffectFilter{Stuck: true}, admin.Page{})
	require.NoError(t, err)
	_, err = a.InspectInbox(ctx, inbox.ID{Consumer: "orders", Tenant: "t1", Key: "f1"}, admin.InspectOptions{Body: true})
	require.NoError(t, err)
	_, err = a.InspectEffect(ctx, admin.EffectID{Tenant: "t1", Kind: "email", Key: "d1"})
	require.NoError(t, err)
	_, err = a.Find(ctx, "d1", admin.FindFilter{})
	require.NoError(t, err)
	groups, err := a.ListGroups(ctx, admin.GroupFilter{}, admin.Page{})
	require.NoError(t, err)
	require.Len(t, groups.Rows, 4)
	_, err = a.ListGroups(ctx, admin.GroupFilter{Code: "bad"}, admin.Page{Limit: 1})
	require.NoError(t, err)
	note := admin.Audit{Who: "ops", Why: "audit"}
	acted := map[string]bool{}
	for _, g := range groups.Rows {
		act := admin.GroupAction{ID: g.ID, Through: g.LastSeen, Note: note}
		_, err = a.Group(ctx, g.ID, admin.TimeRange{})
		require.NoError(t, err)
		switch {
		case g.Source == admin.SourceInbox:
			_, err = a.ReleaseGroup(ctx, act)
		case !acted["retry"]:
			acted["retry"] = true
			_, err = a.RetryGroup(ctx, admin.GroupAction{ID: g.ID, Through: g.LastSeen, DryRun: true})
			require.NoError(t, err)
			_, err = a.RetryGroup(ctx, act)
		default:
			_, err = a.DiscardGroup(ctx, act)
		}
		require.NoError(t, err)
	}
	_, err = a.ListActions(ctx, admin.ActionFilter{Group: groups.Rows[0].ID}, admin.Page{})
	require.NoError(t, err)
	_, err = db.Exec(ctx, `UPDATE effects SET state = 'dead'`)
	require.NoError(t, err)
	require.NoError(t, a.Requeue(ctx, admin.EffectID{Tenant: "t1", Kind: "email", Key: "d1"}))
	_, err = a.RequeueDead(ctx, effectsdb.RequeueFilter{Kind: "email"})
	require.NoError(t, err)
	_, err = db.Exec(ctx, `INSERT INTO inbox (consumer, tenant, key, fingerprint, state, completed_at, expires_at)
		VALUES ('orders', 't1', 'k', '\x01', 'completed', now(), now() + interval '1 day')`)
	require.NoError(t, err)
	_, err = a.Forget(ctx, inbox.ID{Consumer: "orders", Tenant: "t1", Key: "k"}, note)
	require.NoError(t, err)

	stmts := log.all()
	require.Greater(t, len(stmts), 20)
	refused, unused := checkCitus(stmts, adminCitusPending(schema))
	require.Empty(t, refused, "admin statements that Citus refuses:\n%s", strings.Join(refused, "\n\n"))
	require.Empty(t, unused, "adminCitusPending entries that matched no refused statement: remove them")
}

// adminCitusPending are the statements admin sends on plain Postgres that Citus
// refuses, each with why it may.
func adminCitusPending(schema string) []allowed {
	t := regexp.QuoteMeta(pgx.Identifier{schema}.Sanitize()) + `\.`
	return []allowed{
		// Find walks the distinct (consumer, tenant) and (tenant, kind) pairs with a
		// loose index scan; on Citus it reads each shard's rows for the key instead
		// (TestCitusAdminReads).
		{why: "Find: plain Postgres's loose index scan", re: `^WITH RECURSIVE pairs AS \( \(SELECT (consumer, tenant|tenant, kind) FROM ` + t + `"?(inbox|effects)"? .*$`},
	}
}
