package httpidem

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/cpustat"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/pgtest"
)

// BenchmarkRequestSQL is the Postgres side of one request alone, without HTTP:
// the CPU time of the backends per transaction ("pg-µs/tx"), and of this process
// ("go-µs/tx", the client's side) with its allocations, for the bare
// handler's statements and for transactional mode's, sent as the middleware sends
// them, and for variants of the inbox table and the statements, in alternating
// rounds on sqlClients connections. It says where Postgres's time per request goes.
// IDEM_SQL_VARIANTS (names, comma-separated) runs only those.
//
//	go test -run '^$' -bench RequestSQL -benchtime 20000x ./httpidem
func BenchmarkRequestSQL(b *testing.B) {
	pool, schema := pgtest.Setup(b, pgtest.Options{MaxConns: sqlClients + 1})
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE payments (id bigserial PRIMARY KEY, tenant text NOT NULL, amount numeric NOT NULL)`)
	require.NoError(b, err)
	store, err := newResponseStore(schema)
	require.NoError(b, err)
	prepared := newPreparedStmts(store)
	var seq atomic.Int64
	claim := func() inboxdb.Claim {
		return inboxdb.Claim{ID: inboxdb.ID{Consumer: "POST /payments", Key: "k-" + strconv.FormatInt(seq.Add(1), 10)},
			Fingerprint: make([]byte, 32)}
	}
	insert := func(conn *pgx.Conn) error {
		var id int64
		return conn.QueryRow(ctx, `INSERT INTO payments (tenant, amount) VALUES ('', $1::numeric) RETURNING id`, "12").Scan(&id)
	}
	answer := &storedResponse{Status: 201, headerLines: []byte("Content-Type: application/json\r\nLocation: /payments/123\r\n"),
		Body: []byte(`{"id":123,"amount":12}`)}

	// table makes a copy of the inbox under name with change applied to its DDL.
	table := func(name, ddl string) {
		_, err := pool.Exec(ctx, strings.ReplaceAll(ddl, "$t", name))
		require.NoError(b, err)
	}
	table("inbox_c", `CREATE TABLE $t (LIKE inbox INCLUDING ALL);
		ALTER TABLE $t ALTER consumer TYPE text COLLATE "C", ALTER tenant TYPE text COLLATE "C", ALTER key TYPE text COLLATE "C"`)
	table("inbox_nocheck", `CREATE TABLE $t (LIKE inbox INCLUDING DEFAULTS INCLUDING INDEXES)`)
	table("inbox_noidx", `CREATE TABLE $t (LIKE inbox INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
		ALTER TABLE $t ADD PRIMARY KEY (consumer, tenant, key)`)
	// generic is the request's statements on table t, pipelined as the middleware
	// does, through pgx, but with the transaction's settings in a statement of
	// their own (mark) or none, and the answer's UPDATE guarded as
	// SaveResponseOrFail is (guard) or plain.
	generic := func(t string, mark, guard bool) func(conn *pgx.Conn) error {
		claimSQL := `INSERT INTO ` + t + ` (consumer, tenant, key, fingerprint, state, completed_at, expires_at)
			VALUES ($1, $2, $3, $4, 'completed', now(), now() + $5::interval)
			ON CONFLICT (consumer, tenant, key) DO NOTHING RETURNING ctid`
		update := `UPDATE ` + t + ` SET response_status = $5, response_headers = $6, response_body = $7, response_ref = $8
			WHERE ctid = $4 AND consumer = $1 AND tenant = $2 AND key = $3 AND state = 'completed'`
		if guard {
			update = strings.Replace(store.q.SaveResponseOrFail, pgschema.Table(schema, "inbox"), t, 1)
		}
		return func(conn *pgx.Conn) error {
			c := claim()
			bt := &pgx.Batch{}
			bt.Queue(beginSQL)
			if mark {
				bt.Queue(`SELECT set_config('lock_timeout', $1, true), set_config('idem.tx', 'on', true)`, "2000")
			}
			var tid pgtype.TID
			bt.Queue(claimSQL, c.Consumer, c.Tenant, c.Key, c.Fingerprint, 24*time.Hour).QueryRow(func(r pgx.Row) error { return r.Scan(&tid) })
			if err := conn.SendBatch(ctx, bt).Close(); err != nil {
				return err
			}
			if err := insert(conn); err != nil {
				return err
			}
			bt = &pgx.Batch{}
			bt.Queue(update, append([]any{c.Consumer, c.Tenant, c.Key, tid}, responseArgs(answer)...)...)
			bt.Queue("commit")
			return conn.SendBatch(ctx, bt).Close()
		}
	}
	// steps runs BEGIN, the statements and COMMIT, one round trip each.
	steps := func(stmts ...func(conn *pgx.Conn, c inboxdb.Claim, tid *pgtype.TID) error) func(conn *pgx.Conn) error {
		return func(conn *pgx.Conn) error {
			c := claim()
			var tid pgtype.TID
			if _, err := conn.Exec(ctx, "begin"); err != nil {
				return err
			}
			for _, st := range stmts {
				if err := st(conn, c, &tid); err != nil {
					return err
				}
			}
			_, err := conn.Exec(ctx, "commit")
			return err
		}
	}
	pay := func(conn *pgx.Conn, _ inboxdb.Claim, _ *pgtype.TID) error { return insert(conn) }
	plainClaim := func(conn *pgx.Conn, c inboxdb.Claim, _ *pgtype.TID) error {
		_, err := conn.Exec(ctx, `INSERT INTO inbox (consumer, tenant, key, fingerprint, state, completed_at, expires_at)
			VALUES ($1, $2, $3, $4, 'completed', now(), now() + $5::interval)`, c.Consumer, c.Tenant, c.Key, c.Fingerprint, 24*time.Hour)
		return err
	}
	conflictClaim := func(conn *pgx.Conn, c inboxdb.Claim, tid *pgtype.TID) error {
		return conn.QueryRow(ctx, store.q.ClaimReturningRow, c.Consumer, c.Tenant, c.Key, c.Fingerprint, 24*time.Hour).Scan(tid)
	}
	plainUpdate := func(conn *pgx.Conn, c inboxdb.Claim, tid *pgtype.TID) error {
		_, err := conn.Exec(ctx, `UPDATE inbox SET response_status = $5, response_headers = $6, response_body = $7, response_ref = $8
			WHERE ctid = $4 AND consumer = $1 AND tenant = $2 AND key = $3 AND state = 'completed'`,
			append([]any{c.Consumer, c.Tenant, c.Key, *tid}, responseArgs(answer)...)...)
		return err
	}
	// merged: the claim sets lock_timeout and the mark itself, as the middleware
	// sends it.
	mergedClaim := store.q.ClaimMarkedReturningRow
	merged := func(conn *pgx.Conn) error {
		c := claim()
		bt := &pgx.Batch{}
		bt.Queue(beginSQL)
		var tid pgtype.TID
		bt.Queue(mergedClaim, c.Consumer, c.Tenant, c.Key, c.Fingerprint, 24*time.Hour, "2000").QueryRow(func(r pgx.Row) error { return r.Scan(&tid) })
		if err := conn.SendBatch(ctx, bt).Close(); err != nil {
			return err
		}
		if err := insert(conn); err != nil {
			return err
		}
		bt = &pgx.Batch{}
		bt.Queue(store.q.SaveResponseOrFail, append([]any{c.Consumer, c.Tenant, c.Key, tid}, responseArgs(answer)...)...)
		bt.Queue("commit")
		return conn.SendBatch(ctx, bt).Close()
	}
	variants := []struct {
		name string
		run  func(conn *pgx.Conn) error
	}{
		{"bare", func(conn *pgx.Conn) error {
			if _, err := conn.Exec(ctx, "begin"); err != nil {
				return err
			}
			if err := insert(conn); err != nil {
				return err
			}
			_, err := conn.Exec(ctx, "commit")
			return err
		}},
		{"idem", func(conn *pgx.Conn) error {
			c := claim()
			res, d, err := store.ClaimResponsePrepared(ctx, conn, prepared, c, 2*time.Second)
			if err == nil && !res.Claimed {
				err = fmt.Errorf("not claimed")
			}
			if err != nil {
				return err
			}
			if err := insert(conn); err != nil {
				return err
			}
			return store.saveCommitPrepared(ctx, conn, d, c.ID, res.Row, answer)
		}},
		{"pgx", merged},
		{"pgx-settings-apart", generic("inbox", true, true)},
		{"pgx-noguard", generic("inbox", true, false)},
		{"pgx-collate-c", generic("inbox_c", true, true)},
		{"pgx-nocheck", generic("inbox_nocheck", true, true)},
		{"pgx-noexpiryindex", generic("inbox_noidx", true, true)},
		{"steps-pay-pay", steps(pay, pay)},
		{"steps-claim-pay", steps(conflictClaim, pay)},
		{"steps-plainclaim-pay", steps(plainClaim, pay)},
		{"steps-claim-pay-update", steps(conflictClaim, pay, plainUpdate)},
	}
	if only := os.Getenv("IDEM_SQL_VARIANTS"); only != "" {
		keep := variants[:0]
		for _, v := range variants {
			if slices.Contains(strings.Split(only, ","), v.name) {
				keep = append(keep, v)
			}
		}
		variants = keep
	}
	app := "idem-test:" + schema
	cost := make([]cpustat.Delta, len(variants))
	const rounds = 10
	per := max(b.N/rounds, sqlClients)
	for _, v := range variants { // warm up: connections, plans
		runSQL(b, pool, v.run, 10*sqlClients)
	}
	b.ResetTimer()
	for r := range rounds {
		for i := range variants {
			i = (i + r) % len(variants)
			before := cpustat.Take(ctx, pool, app)
			runSQL(b, pool, variants[i].run, per)
			d := cpustat.Take(ctx, pool, app).Since(before)
			cost[i].Backends += d.Backends
			cost[i].Self += d.Self
			cost[i].Mallocs += d.Mallocs
		}
	}
	b.StopTimer()
	for i, v := range variants {
		b.ReportMetric(cpustat.PerOp(cost[i].Backends, per*rounds), v.name+"-pg-µs/tx")
		b.ReportMetric(cpustat.PerOp(cost[i].Self, per*rounds), v.name+"-go-µs/tx")
		b.ReportMetric(float64(cost[i].Mallocs)/float64(per*rounds), v.name+"-allocs/tx")
	}
}

const sqlClients = 8

// runSQL runs one request's SQL n times on sqlClients connections.
func runSQL(b *testing.B, pool *pgxpool.Pool, run func(conn *pgx.Conn) error, n int) {
	var next atomic.Int64
	var wg sync.WaitGroup
	for range sqlClients {
		wg.Go(func() {
			c, err := pool.Acquire(context.Background())
			if err != nil {
				b.Error(err)
				return
			}
			defer c.Release()
			for next.Add(1) <= int64(n) {
				if err := run(c.Conn()); err != nil {
					b.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
}
