package chaos_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/chaos"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/pgtest"
)

// The payments scenario shared by the end-to-end tests: each payment message makes
// one ledger row and one email. The ledger has no unique constraint, so a double
// commit shows up as two rows; emails records every send, as an SMTP receiver would.
const (
	consumerName = "payments"
	paymentDDL   = `
CREATE TABLE ledger (id bigserial PRIMARY KEY, key text NOT NULL, payload text NOT NULL);
CREATE TABLE emails (id bigserial PRIMARY KEY, effect_key text NOT NULL, sent_at timestamptz NOT NULL DEFAULT now());`
	ledgerCounts = `SELECT key, count(*) FROM ledger GROUP BY key`
	emailCounts  = `SELECT effect_key, count(*) FROM emails GROUP BY effect_key`
)

// flavour is what sits between the broker and the handler.
type flavour string

const (
	idemTransactional flavour = "idem/transactional"
	idemGroupCommit   flavour = "idem/group-commit"
	peerDeduplicator  flavour = "watermill-deduplicator"
)

func (f flavour) mode() consumer.Mode {
	if f == idemGroupCommit {
		return consumer.GroupCommit
	}
	return consumer.Transactional
}

func emailKey(key string) string { return "receipt:" + key }

func setupPayments(t *testing.T, maxConns int32) (*pgxpool.Pool, string) {
	t.Helper()
	pool, schema := pgtest.Setup(t, pgtest.Options{MaxConns: maxConns})
	_, err := pool.Exec(context.Background(), paymentDDL)
	require.NoError(t, err)
	return pool, schema
}

// errFlaky is the transient failure the handler injects.
var errFlaky = errors.New("flaky: connection reset by peer")

// stack is a handler with its middleware, for one flavour.
type stack struct {
	handler message.HandlerFunc
	reg     *prometheus.Registry
	close   func()
	// restart forgets in-memory state, as a process restart does.
	restart func()
}

// paymentHandler writes the ledger row and the email: as an idem effect under
// idem, or as a direct send (a row in emails) for the peer, which has no effects.
// flaky, when it returns true, fails the delivery after the writes, transiently.
func paymentHandler(f flavour, pool *pgxpool.Pool, flaky func(*message.Message) bool) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if f != peerDeduplicator {
			tx := consumer.Tx(ctx)
			if _, err := tx.Exec(ctx, `INSERT INTO ledger (key, payload) VALUES ($1, $2)`, msg.UUID, string(msg.Payload)); err != nil {
				return nil, err
			}
			if _, err := effects.Enqueue(ctx, tx, effects.Effect{Kind: "email", Key: emailKey(msg.UUID), Payload: msg.Payload}); err != nil {
				return nil, err
			}
			if flaky != nil && flaky(msg) {
				return nil, errFlaky
			}
			chaos.Crash(chaos.BeforeCommit)
			return nil, nil
		}
		// The peer: a plain handler with its own transaction and a direct send.
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO ledger (key, payload) VALUES ($1, $2)`, msg.UUID, string(msg.Payload)); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `INSERT INTO emails (effect_key) VALUES ($1)`, emailKey(msg.UUID)); err != nil {
				return err
			}
			if flaky != nil && flaky(msg) {
				return errFlaky
			}
			chaos.Crash(chaos.BeforeCommit)
			return nil
		})
		return nil, err
	}
}

// newStack builds the handler of a flavour. The crash middleware sits outside
// everything, so AfterCommitBeforeAck fires after the commit and before the ack.
func newStack(f flavour, pool *pgxpool.Pool, schema string, flaky func(*message.Message) bool, mutate func(*consumer.Config)) *stack {
	h := paymentHandler(f, pool, flaky)
	st := &stack{reg: prometheus.NewRegistry(), close: func() {}, restart: func() {}}
	if f == peerDeduplicator {
		var cur atomic.Pointer[message.HandlerFunc]
		fresh := func() {
			repo, err := middleware.NewMapExpiringKeyRepository(time.Minute)
			if err != nil {
				panic(err)
			}
			d := &middleware.Deduplicator{
				KeyFactory: func(m *message.Message) (string, error) { return m.UUID, nil },
				Repository: repo,
			}
			mw := d.Middleware(h) // it sets its defaults here, so build it once
			cur.Store(&mw)
		}
		fresh()
		st.restart = fresh
		st.handler = chaos.CrashMiddleware(func(msg *message.Message) ([]*message.Message, error) {
			return (*cur.Load())(msg)
		})
		return st
	}
	cfg := consumer.Config{
		Name: consumerName, Pool: pool, Schema: schema, Mode: f.mode(),
		LockTimeout: 2 * time.Second, BusyDelay: 5 * time.Millisecond,
		Registerer: st.reg,
	}
	if cfg.Mode != consumer.Lease {
		cfg.Batch.Workers = 1
	}
	if mutate != nil {
		mutate(&cfg)
	}
	c, err := consumer.New(cfg)
	if err != nil {
		panic(err)
	}
	st.close = func() { _ = c.Close() }
	st.handler = chaos.CrashMiddleware(c.Middleware(h))
	return st
}

func (s *stack) counter(name string) int64 {
	mfs, _ := s.reg.Gather()
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() == name {
			for _, m := range mf.GetMetric() {
				sum += m.GetCounter().GetValue()
			}
		}
	}
	return int64(math.Round(sum))
}

// sendEmails is a stand-in for the effects Dispatcher (built elsewhere): it claims
// due email effects with a short lease, "sends" each one (a row in emails), calls
// the MidSend crash point, and marks it done. A sender killed mid-send leaves the
// effect pending; it comes due again when the lease ends and is sent again with
// the same effect key.
func sendEmails(ctx context.Context, pool *pgxpool.Pool, lease time.Duration) (int, error) {
	sent := 0
	for {
		var key string
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			return tx.QueryRow(ctx, `UPDATE effects SET next_attempt_at = now() + $1::interval, attempts = attempts + 1
				WHERE (kind, key) = (SELECT kind, key FROM effects
					WHERE kind = 'email' AND state = 'pending' AND next_attempt_at <= now()
					ORDER BY next_attempt_at LIMIT 1 FOR UPDATE SKIP LOCKED)
				RETURNING key`, fmt.Sprintf("%d milliseconds", lease.Milliseconds())).Scan(&key)
		})
		if errors.Is(err, pgx.ErrNoRows) {
			return sent, nil
		}
		if err != nil {
			return sent, err
		}
		if _, err := pool.Exec(ctx, `INSERT INTO emails (effect_key) VALUES ($1)`, key); err != nil {
			return sent, err
		}
		chaos.Crash(chaos.MidSend)
		if _, err := pool.Exec(ctx, `UPDATE effects SET state = 'done', done_at = now() WHERE kind = 'email' AND key = $1`, key); err != nil {
			return sent, err
		}
		sent++
	}
}

// auditQuery is the payments audit for a flavour.
func auditQuery(f flavour, keys []string, deliveries, suppressed int64) chaos.AuditQuery {
	q := chaos.AuditQuery{
		Consumer: consumerName, ExpectedKeys: keys, BusinessSQL: ledgerCounts,
		SendKey: emailKey, Deliveries: deliveries, DuplicatesSuppressed: suppressed,
		WithoutInbox: f == peerDeduplicator,
	}
	if f != peerDeduplicator {
		q.EffectKind, q.EffectKey = "email", emailKey
	}
	return q
}

// withSends counts the emails table as the sends.
func withSends(q chaos.AuditQuery, pool *pgxpool.Pool) chaos.AuditQuery {
	q.Sends = func(ctx context.Context) (map[string]int, error) { return keyCounts(ctx, pool, emailCounts) }
	return q
}

func keyCounts(ctx context.Context, pool *pgxpool.Pool, sql string) (map[string]int, error) {
	rows, err := pool.Query(ctx, sql)
	if err != nil {
		return nil, err
	}
	m := map[string]int{}
	var k string
	var n int
	_, err = pgx.ForEachRow(rows, []any{&k, &n}, func() error { m[k] = n; return nil })
	return m, err
}

func paymentKeys(n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("pay-%05d", i)
	}
	return keys
}

func paymentPayload(key string) []byte { return []byte(`{"payment":"` + key + `","amount":100}`) }
