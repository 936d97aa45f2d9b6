package admin_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/httpidem"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/pgtest"
)

type testBundle struct {
	pool   *pgxpool.Pool
	schema string
	logs   *syncBuffer
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func setup(t *testing.T) (*admin.Admin, *testBundle) {
	t.Helper()
	t.Parallel()
	pool, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 4})
	logs := &syncBuffer{}
	a, err := admin.New(admin.Config{Pool: pool, Schema: schema, Logger: slog.New(slog.NewJSONHandler(logs, nil))})
	require.NoError(t, err)
	return a, &testBundle{pool: pool, schema: schema, logs: logs}
}

func (b *testBundle) exec(t *testing.T, sql string, args ...any) {
	t.Helper()
	_, err := b.pool.Exec(context.Background(), sql, args...)
	require.NoError(t, err)
}

func ptr[T any](v T) *T { return &v }

// TestNewValidates: Validate passes on a config that sets only what is required
// (it checks the defaulted config), WithDefaults fills every default, and New
// refuses a config with "invalid config: " and a coded error.
func TestNewValidates(t *testing.T) {
	t.Parallel()
	fresh := admin.Config{Pool: &pgxpool.Pool{}}
	require.NoError(t, fresh.Validate())
	d := fresh.WithDefaults()
	require.Equal(t, inbox.DefaultSchema, d.Schema)
	require.Equal(t, admin.DefaultStuckAfter, d.StuckAfter)
	require.Equal(t, admin.DefaultStuckAttempts, d.StuckAttempts)
	require.NotNil(t, d.Logger)
	_, err := admin.New(admin.Config{})
	require.True(t, strings.HasPrefix(err.Error(), "invalid config: "), err.Error())
	require.ErrorIs(t, err, admin.ErrInvalidConfig)
	require.Equal(t, "invalid_config", inbox.Code(err))
	pool, _ := pgtest.Setup(t, pgtest.Options{MaxConns: 1, NoMigrate: true})
	_, err = admin.New(admin.Config{Pool: pool, Schema: "Bad-Schema"})
	require.ErrorIs(t, err, inbox.ErrInvalidSchema)
	a, err := admin.New(admin.Config{Pool: pool})
	require.NoError(t, err)
	require.Equal(t, inbox.DefaultSchema, a.Schema())
}

func TestStats(t *testing.T) {
	a, b := setup(t)
	b.exec(t, `INSERT INTO inbox (consumer, tenant, key, fingerprint, state, received_at, expires_at, lease_until) VALUES
		('billing', '', 'old', '\x00', 'completed', now() - interval '2 days', now() - interval '1 s', NULL),
		('payments', 'acme', 'p1', '\x00', 'completed', now(), now() + interval '7 days', NULL),
		('payments', 'acme', 'p2', '\x00', 'failed', now(), now() + interval '7 days', NULL),
		('payments', 'globex', 'p1', '\x00', 'processing', now() - interval '10 minutes', now() + interval '7 days', now() + interval '1 minute')`)
	b.exec(t, `INSERT INTO effects (tenant, kind, key, fingerprint, state, attempts, in_flight, created_at, next_attempt_at) VALUES
		('', 'sms', 'late', '\x00', 'pending', 0, false, now() - interval '2 hours', now() + interval '1 hour'),
		('', 'sms', 'due', '\x00', 'pending', 0, false, now() - interval '1 hour', now() - interval '1 second'),
		('', 'sms', 'overdue', '\x00', 'pending', 0, false, now() - interval '1 hour', now() - interval '10 minutes'),
		('acme', 'sms', 'sending', '\x00', 'pending', 1, true, now(), now() + interval '30 seconds'),
		('acme', 'sms', 'retrying', '\x00', 'pending', 4, false, now(), now() + interval '1 minute'),
		('', 'sms', 'dead', '\x00', 'dead', 25, false, now(), now()),
		('', 'email', 'done', '\x00', 'done', 1, false, now(), now())`)

	s, err := a.Stats(context.Background())
	require.NoError(t, err)
	require.Equal(t, b.schema, s.Schema)
	require.Len(t, s.Consumers, 2)
	billing, payments := s.Consumers[0], s.Consumers[1]
	require.Equal(t, admin.ConsumerStats{Consumer: "billing", Rows: 1, Completed: 1, Expired: 1}, withoutTimes(billing))
	require.Equal(t, admin.ConsumerStats{Consumer: "payments", Rows: 3, Completed: 1, Failed: 1, Processing: 1}, withoutTimes(payments))
	require.InDelta(t, 600, payments.OldestProcessingSeconds, 60)
	require.Len(t, s.Effects, 2)
	require.Equal(t, admin.KindStats{Kind: "email", Done: 1}, s.Effects[0])
	sms := s.Effects[1]
	require.InDelta(t, 7200, sms.OldestPendingSeconds, 60)
	require.InDelta(t, 2*time.Hour, sms.OldestPendingAge(), float64(time.Minute))
	sms.OldestPendingSeconds = 0
	// stuck: overdue (due 10 min ago), sending (in flight), retrying (4 attempts).
	require.Equal(t, admin.KindStats{Kind: "sms", Pending: 5, Due: 2, Dead: 1, InFlight: 1, Stuck: 3}, sms)
}

func withoutTimes(s admin.ConsumerStats) admin.ConsumerStats {
	s.Oldest, s.OldestProcessingSeconds = nil, 0
	return s
}

func TestStatsOnAMissingSchema(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 1, NoMigrate: true})
	a, err := admin.New(admin.Config{Pool: pool, Schema: schema})
	require.NoError(t, err)
	_, err = a.Stats(context.Background())
	require.ErrorIs(t, err, inbox.ErrSchemaMissing)
	_, err = a.ListEffects(context.Background(), admin.EffectFilter{}, admin.Page{})
	require.ErrorIs(t, err, inbox.ErrSchemaMissing)
	_, err = a.ListInbox(context.Background(), admin.InboxFilter{}, admin.Page{})
	require.ErrorIs(t, err, inbox.ErrSchemaMissing)
}

// listAllInbox pages through the inbox with limit, calling between(page) after
// each page, and returns every key seen in order.
func listAllInbox(t *testing.T, a *admin.Admin, f admin.InboxFilter, limit int, between func(page int)) []string {
	t.Helper()
	var seen []string
	p := admin.Page{Limit: limit}
	for page := 0; ; page++ {
		out, err := a.ListInbox(context.Background(), f, p)
		require.NoError(t, err)
		require.LessOrEqual(t, len(out.Rows), limit)
		for _, k := range out.Rows {
			seen = append(seen, k.Consumer+"|"+k.Tenant+"|"+k.Key)
		}
		if out.Next == "" {
			return seen
		}
		require.Len(t, out.Rows, limit, "a page with a next cursor is full")
		if between != nil {
			between(page)
		}
		p.After = out.Next
		require.Less(t, page, 1000, "paging does not end")
	}
}

// TestListInboxPagingWithInserts: keyset paging returns every key that exists for
// the whole walk exactly once and in primary key order, whatever is inserted or
// deleted between pages; a key inserted behind the cursor is not seen, one
// inserted ahead of it is.
func TestListInboxPagingWithInserts(t *testing.T) {
	a, b := setup(t)
	for _, c := range []string{"billing", "payments"} {
		for _, tenant := range []string{"", "acme"} {
			b.exec(t, `INSERT INTO inbox (consumer, tenant, key, fingerprint, state, expires_at)
				SELECT $1, $2, 'k' || lpad(i::text, 3, '0'), '\x00', 'completed', now() + interval '1 day'
				FROM generate_series(10, 200, 10) i`, c, tenant)
		}
	}
	var before []string
	for _, c := range []string{"billing", "payments"} {
		for _, tenant := range []string{"", "acme"} {
			for i := 10; i <= 200; i += 10 {
				before = append(before, fmt.Sprintf("%s|%s|k%03d", c, tenant, i))
			}
		}
	}
	// Between pages: a key behind everything seen (k001 of billing), a key ahead
	// (k205 of payments/acme, the very end), a key between two existing ones ahead
	// (payments||k015), and a delete ahead (payments||k020).
	between := func(page int) {
		if page != 0 {
			return
		}
		b.exec(t, `INSERT INTO inbox (consumer, tenant, key, fingerprint, state, expires_at) VALUES
			('billing', '', 'k001', '\x00', 'completed', now() + interval '1 day'),
			('payments', 'acme', 'k205', '\x00', 'completed', now() + interval '1 day'),
			('payments', '', 'k015', '\x00', 'completed', now() + interval '1 day')`)
		b.exec(t, `DELETE FROM inbox WHERE consumer = 'payments' AND tenant = '' AND key = 'k020'`)
	}
	seen := listAllInbox(t, a, admin.InboxFilter{}, 7, between)
	var want []string
	for _, k := range before {
		if k == "payments||k020" {
			continue
		}
		want = append(want, k)
		if k == "payments||k010" {
			want = append(want, "payments||k015")
		}
	}
	want = append(want, "payments|acme|k205")
	require.Equal(t, want, seen)
	require.NotContains(t, seen, "billing||k001", "inserted behind the cursor")

	// The same walk with filters, and a page size that divides the rows exactly
	// (the last page is full and the one after it is empty).
	seen = listAllInbox(t, a, admin.InboxFilter{Consumer: "billing", Tenant: ptr("")}, 3, nil)
	require.Len(t, seen, 21)
	require.Equal(t, "billing||k001", seen[0])
	seen = listAllInbox(t, a, admin.InboxFilter{Consumer: "billing", Tenant: ptr("acme"), KeyPrefix: "k1"}, 5, nil)
	require.Equal(t, []string{"billing|acme|k100", "billing|acme|k110", "billing|acme|k120", "billing|acme|k130",
		"billing|acme|k140", "billing|acme|k150", "billing|acme|k160", "billing|acme|k170", "billing|acme|k180", "billing|acme|k190"}, seen)
}

func TestListInboxFilters(t *testing.T) {
	a, b := setup(t)
	ctx := context.Background()
	b.exec(t, `INSERT INTO inbox (consumer, tenant, key, fingerprint, state, received_at, expires_at, error_code, error) VALUES
		('payments', 'acme', 'pay_1', '\x01', 'completed', now() - interval '3 days', now() + interval '4 days', NULL, NULL),
		('payments', 'acme', 'pay_2', '\x02', 'failed', now() - interval '1 day', now() + interval '6 days', 'permanent', 'card declined'),
		('payments', '', 'pay_3', '\x03', 'completed', now(), now() + interval '7 days', NULL, NULL),
		('payments', 'acme', 'refund_1', '\x04', 'completed', now(), now() + interval '7 days', NULL, NULL),
		('POST /payments', 'acme', 'pay_1', '\x05', 'completed', now(), now() + interval '1 day', NULL, NULL)`)
	keys := func(f admin.InboxFilter) []string {
		t.Helper()
		out, err := a.ListInbox(ctx, f, admin.Page{})
		require.NoError(t, err)
		var ks []string
		for _, k := range out.Rows {
			ks = append(ks, k.Consumer+"|"+k.Tenant+"|"+k.Key)
		}
		return ks
	}
	require.Equal(t, []string{"POST /payments|acme|pay_1", "payments||pay_3", "payments|acme|pay_1", "payments|acme|pay_2", "payments|acme|refund_1"}, keys(admin.InboxFilter{}))
	require.Equal(t, []string{"payments||pay_3"}, keys(admin.InboxFilter{Tenant: ptr("")}))
	require.Equal(t, []string{"payments|acme|pay_2"}, keys(admin.InboxFilter{State: "failed"}))
	require.Equal(t, []string{"payments||pay_3", "payments|acme|pay_1", "payments|acme|pay_2"}, keys(admin.InboxFilter{Consumer: "payments", KeyPrefix: "pay_"}))
	now := time.Now()
	require.Equal(t, []string{"payments|acme|pay_1", "payments|acme|pay_2"}, keys(admin.InboxFilter{Consumer: "payments", Received: admin.TimeRange{Until: now.Add(-time.Hour)}}))
	require.Equal(t, []string{"payments|acme|pay_2"}, keys(admin.InboxFilter{Received: admin.TimeRange{Since: now.Add(-50 * time.Hour), Until: now.Add(-time.Hour)}}))
	require.Empty(t, keys(admin.InboxFilter{KeyPrefix: "%"}), "a prefix is text, not a LIKE pattern")

	out, err := a.ListInbox(ctx, admin.InboxFilter{State: "failed"}, admin.Page{})
	require.NoError(t, err)
	k := out.Rows[0]
	require.Equal(t, "permanent", k.ErrorCode)
	require.Equal(t, "card declined", k.Error)
	require.Equal(t, "02", k.Fingerprint)

	_, err = a.ListInbox(ctx, admin.InboxFilter{State: "pending"}, admin.Page{})
	require.ErrorIs(t, err, admin.ErrBadFilter)
	_, err = a.ListInbox(ctx, admin.InboxFilter{}, admin.Page{Limit: -1})
	require.ErrorIs(t, err, admin.ErrBadFilter)
	_, err = a.ListInbox(ctx, admin.InboxFilter{}, admin.Page{After: "garbage"})
	require.ErrorIs(t, err, admin.ErrBadCursor)
	require.Equal(t, "bad_cursor", inbox.Code(err))
	// A long cursor is clipped in the message, never inside a character: the
	// message quotes whole characters, no \x escape of half of one.
	_, err = a.ListInbox(ctx, admin.InboxFilter{}, admin.Page{After: "a" + strings.Repeat("é", 40)})
	require.ErrorIs(t, err, admin.ErrBadCursor)
	require.NotContains(t, err.Error(), `\x`)
	require.Contains(t, err.Error(), `"a`+strings.Repeat("é", 19)+`…"`)
	page, err := a.ListEffects(ctx, admin.EffectFilter{}, admin.Page{})
	require.NoError(t, err)
	require.Empty(t, page.Next)
	first, err := a.ListInbox(ctx, admin.InboxFilter{}, admin.Page{Limit: 1})
	require.NoError(t, err)
	_, err = a.ListEffects(ctx, admin.EffectFilter{}, admin.Page{After: first.Next})
	require.ErrorIs(t, err, admin.ErrBadCursor, "an inbox cursor is not an effects cursor")
}

func TestListEffectsFiltersAndPaging(t *testing.T) {
	a, b := setup(t)
	ctx := context.Background()
	b.exec(t, `INSERT INTO effects (tenant, kind, key, fingerprint, payload, state, attempts, in_flight, last_error,
			created_at, next_attempt_at, source_consumer, source_tenant, source_key) VALUES
		('', 'email', 'receipt:1', '\x00', 'hello', 'dead', 25, false, 'smtp: 550 <b>mailbox</b> unavailable', now() - interval '3 days', now(), 'payments', '', 'pay_1'),
		('acme', 'email', 'receipt:1', '\x00', NULL, 'dead', 25, false, 'smtp: 550', now() - interval '1 day', now(), 'payments', 'acme', 'pay_1'),
		('acme', 'email', 'receipt:2', '\x00', NULL, 'pending', 1, true, 'timeout', now(), now() - interval '5 seconds', 'payments', 'acme', 'pay_2'),
		('acme', 'sms', 'text:1', '\x00', NULL, 'pending', 0, false, NULL, now(), now() + interval '1 hour', 'POST /payments', 'acme', 'k1'),
		('globex', 'email', 'receipt:9', '\x00', NULL, 'done', 1, false, NULL, now(), now(), NULL, NULL, NULL)`)
	ids := func(f admin.EffectFilter) []string {
		t.Helper()
		out, err := a.ListEffects(ctx, f, admin.Page{})
		require.NoError(t, err)
		var s []string
		for _, e := range out.Rows {
			s = append(s, e.ID().String())
		}
		return s
	}
	require.Equal(t, []string{"email/receipt:1", "acme:email/receipt:1", "acme:email/receipt:2", "acme:sms/text:1", "globex:email/receipt:9"}, ids(admin.EffectFilter{}))
	require.Equal(t, []string{"email/receipt:1", "acme:email/receipt:1"}, ids(admin.EffectFilter{State: "dead"}))
	require.Equal(t, []string{"email/receipt:1"}, ids(admin.EffectFilter{State: "dead", Tenant: ptr("")}))
	require.Equal(t, []string{"acme:email/receipt:1", "acme:email/receipt:2"}, ids(admin.EffectFilter{Tenant: ptr("acme"), Kind: "email"}))
	require.Equal(t, []string{"acme:sms/text:1"}, ids(admin.EffectFilter{Consumer: "POST /payments"}))
	require.Equal(t, []string{"acme:email/receipt:2"}, ids(admin.EffectFilter{KeyPrefix: "receipt:", State: "pending"}))
	require.Equal(t, []string{"email/receipt:1"}, ids(admin.EffectFilter{Created: admin.TimeRange{Until: time.Now().Add(-48 * time.Hour)}}))
	require.Equal(t, []string{"acme:email/receipt:2"}, ids(admin.EffectFilter{Stuck: true}))

	out, err := a.ListEffects(ctx, admin.EffectFilter{Tenant: ptr("")}, admin.Page{})
	require.NoError(t, err)
	e := out.Rows[0]
	require.Equal(t, 5, e.PayloadBytes)
	require.Equal(t, "smtp: 550 <b>mailbox</b> unavailable", e.LastError)
	src, ok := e.Source()
	require.True(t, ok)
	require.Equal(t, inbox.ID{Consumer: "payments", Key: "pay_1"}, src)
	out, err = a.ListEffects(ctx, admin.EffectFilter{Stuck: true}, admin.Page{})
	require.NoError(t, err)
	require.Contains(t, out.Rows[0].Stuck, "lease ran out")

	_, err = a.ListEffects(ctx, admin.EffectFilter{State: "failed"}, admin.Page{})
	require.ErrorIs(t, err, admin.ErrBadFilter)
	_, err = a.ListEffects(ctx, admin.EffectFilter{State: "dead", Stuck: true}, admin.Page{})
	require.ErrorIs(t, err, admin.ErrBadFilter)

	// Paging with inserts in between: 2 per page over (tenant, kind, key).
	var seen []string
	p := admin.Page{Limit: 2}
	for page := 0; ; page++ {
		out, err := a.ListEffects(ctx, admin.EffectFilter{}, p)
		require.NoError(t, err)
		for _, e := range out.Rows {
			seen = append(seen, e.ID().String())
		}
		if out.Next == "" {
			break
		}
		if page == 0 { // seen: email/receipt:1, acme:email/receipt:1
			b.exec(t, `INSERT INTO effects (tenant, kind, key, fingerprint) VALUES
				('', 'zzz', 'behind', '\x00'), ('acme', 'email', 'receipt:15', '\x00'), ('zeta', 'email', 'x', '\x00')`)
		}
		p.After = out.Next
	}
	require.Equal(t, []string{"email/receipt:1", "acme:email/receipt:1", "acme:email/receipt:15", "acme:email/receipt:2",
		"acme:sms/text:1", "globex:email/receipt:9", "zeta:email/x"}, seen)
}

// process runs one message through a real consumer; the handler counts its runs
// and enqueues an email effect.
type payments struct {
	t    *testing.T
	mw   message.HandlerFunc
	runs atomic.Int64
}

func newPayments(t *testing.T, b *testBundle) *payments {
	p := &payments{t: t}
	c, err := consumer.New(consumer.Config{Name: "payments", Pool: b.pool, Schema: b.schema, Tenant: consumer.MetadataKey("tenant")})
	require.NoError(t, err)
	p.mw = c.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		p.runs.Add(1)
		if string(msg.Payload) == "bad" {
			return nil, consumer.Permanent(errors.New("card declined"))
		}
		ctx := msg.Context()
		_, err := effects.Enqueue(ctx, consumer.Tx(ctx), effects.Effect{Kind: "email", Key: "receipt:" + msg.UUID, Payload: msg.Payload})
		return nil, err
	})
	return p
}

func (p *payments) deliver(tenant, key, payload string) {
	p.t.Helper()
	msg := message.NewMessage(key, []byte(payload))
	msg.Metadata.Set("tenant", tenant)
	_, err := p.mw(msg)
	require.NoError(p.t, err)
}

func TestInspectAndFind(t *testing.T) {
	a, b := setup(t)
	ctx := context.Background()
	p := newPayments(t, b)
	p.deliver("acme", "pay_1", `{"amount":1}`)
	p.deliver("globex", "pay_1", `{"amount":2}`)
	p.deliver("acme", "pay_2", "bad")

	got, err := a.InspectInbox(ctx, inbox.ID{Consumer: "payments", Tenant: "acme", Key: "pay_1"}, admin.InspectOptions{})
	require.NoError(t, err)
	require.Equal(t, "completed", got.State)
	require.Len(t, got.Fingerprint, 64, "32 bytes in hex")
	require.Nil(t, got.Response)
	require.Len(t, got.Effects, 1)
	require.Equal(t, admin.EffectID{Tenant: "acme", Kind: "email", Key: "receipt:pay_1"}, got.Effects[0].ID())

	got, err = a.InspectInbox(ctx, inbox.ID{Consumer: "payments", Tenant: "acme", Key: "pay_2"}, admin.InspectOptions{})
	require.NoError(t, err)
	require.Equal(t, "failed", got.State)
	require.Empty(t, got.Effects)
	require.NotNil(t, got.Effects, "an empty list, not null, in JSON")

	_, err = a.InspectInbox(ctx, inbox.ID{Consumer: "payments", Tenant: "", Key: "pay_1"}, admin.InspectOptions{})
	require.ErrorIs(t, err, admin.ErrNotFound)
	require.Equal(t, "not_found", inbox.Code(err))
	_, err = a.InspectInbox(ctx, inbox.ID{Consumer: "", Key: "pay_1"}, admin.InspectOptions{})
	require.ErrorIs(t, err, inbox.ErrConsumerInvalid)

	e, err := a.InspectEffect(ctx, admin.EffectID{Tenant: "globex", Kind: "email", Key: "receipt:pay_1"})
	require.NoError(t, err)
	require.Equal(t, "pending", e.State)
	require.Equal(t, 12, e.PayloadBytes)
	_, err = a.InspectEffect(ctx, admin.EffectID{Kind: "email", Key: "receipt:pay_1"})
	require.ErrorIs(t, err, admin.ErrNotFound)

	// Find: the key across consumers and tenants, and as an effect key.
	b.exec(t, `INSERT INTO inbox (consumer, tenant, key, fingerprint, state, expires_at) VALUES
		('billing', '', 'pay_1', '\x00', 'completed', now() + interval '1 day'),
		('billing', 'acme', 'other', '\x00', 'completed', now() + interval '1 day')`)
	found, err := a.Find(ctx, "pay_1", admin.FindFilter{})
	require.NoError(t, err)
	var where []string
	for _, k := range found.Inbox {
		where = append(where, k.Consumer+"|"+k.Tenant)
	}
	require.Equal(t, []string{"billing|", "payments|acme", "payments|globex"}, where)
	require.Empty(t, found.Effects)
	found, err = a.Find(ctx, "pay_1", admin.FindFilter{Tenant: ptr("acme")})
	require.NoError(t, err)
	require.Len(t, found.Inbox, 1)
	found, err = a.Find(ctx, "receipt:pay_1", admin.FindFilter{})
	require.NoError(t, err)
	require.Empty(t, found.Inbox)
	require.Len(t, found.Effects, 2)
	require.Equal(t, "acme", found.Effects[0].Tenant)
	require.Equal(t, "globex", found.Effects[1].Tenant)
	found, err = a.Find(ctx, "receipt:pay_1", admin.FindFilter{Kind: "sms"})
	require.NoError(t, err)
	require.Empty(t, found.Effects)
	_, err = a.Find(ctx, "", admin.FindFilter{})
	require.ErrorIs(t, err, admin.ErrBadFilter)
}

// TestInspectHTTPKey: an HTTP key shows its response's status, headers and body
// size; the body only when asked.
func TestInspectHTTPKey(t *testing.T) {
	a, b := setup(t)
	ctx := context.Background()
	mw, err := httpidem.New(httpidem.Config{Pool: b.pool, Schema: b.schema,
		Tenant: func(r *http.Request) (string, error) { return "acct_42", nil }})
	require.NoError(t, err)
	mux := http.NewServeMux()
	mux.Handle("POST /payments", mw.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"id":"pay_1","email":"ann@example.com"}`))
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/payments", strings.NewReader(`{}`))
	req.Header.Set("Idempotency-Key", "k-1")
	resp, err := srv.Client().Do(req)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())

	id := inbox.ID{Consumer: "POST /payments", Tenant: "acct_42", Key: "k-1"}
	got, err := a.InspectInbox(ctx, id, admin.InspectOptions{})
	require.NoError(t, err)
	require.Equal(t, 201, got.Response.Status)
	require.Equal(t, 40, got.Response.BodyBytes)
	require.Equal(t, []string{"Content-Type"}, got.Response.HeaderNames())
	require.Nil(t, got.Response.Body)
	j, err := json.Marshal(got)
	require.NoError(t, err)
	require.NotContains(t, string(j), "ann@example.com")

	got, err = a.InspectInbox(ctx, id, admin.InspectOptions{Body: true})
	require.NoError(t, err)
	require.Contains(t, string(got.Response.Body), "ann@example.com")

	// Lists and Find show the response without its body too.
	page, err := a.ListInbox(ctx, admin.InboxFilter{Consumer: "POST /payments"}, admin.Page{})
	require.NoError(t, err)
	require.Equal(t, &admin.Response{Status: 201, BodyBytes: 40, Headers: map[string][]string{"Content-Type": {"application/json"}}}, page.Rows[0].Response)
	found, err := a.Find(ctx, "k-1", admin.FindFilter{})
	require.NoError(t, err)
	require.Equal(t, 40, found.Inbox[0].Response.BodyBytes)
}

func TestRequeue(t *testing.T) {
	a, b := setup(t)
	ctx := context.Background()
	b.exec(t, `INSERT INTO effects (tenant, kind, key, fingerprint, state, attempts, last_error) VALUES
		('', 'email', 'r1', '\x00', 'dead', 25, 'boom'),
		('acme', 'email', 'r1', '\x00', 'dead', 25, 'boom'),
		('acme', 'email', 'r2', '\x00', 'pending', 1, NULL)`)
	require.NoError(t, a.Requeue(ctx, admin.EffectID{Kind: "email", Key: "r1"}))
	e, err := a.InspectEffect(ctx, admin.EffectID{Kind: "email", Key: "r1"})
	require.NoError(t, err)
	require.Equal(t, "pending", e.State)
	require.Zero(t, e.Attempts)
	require.Equal(t, "boom", e.LastError, "the last error stays until the next attempt")
	e, err = a.InspectEffect(ctx, admin.EffectID{Tenant: "acme", Kind: "email", Key: "r1"})
	require.NoError(t, err)
	require.Equal(t, "dead", e.State, "the unscoped effect's requeue leaves acme's alone")

	err = a.Requeue(ctx, admin.EffectID{Kind: "email", Key: "r1"})
	require.ErrorIs(t, err, admin.ErrNotDead)
	require.ErrorContains(t, err, "is pending, not dead")
	err = a.Requeue(ctx, admin.EffectID{Tenant: "acme", Kind: "email", Key: "nope"})
	require.ErrorIs(t, err, admin.ErrNotFound)

	n, err := a.RequeueDead(ctx, effectsdb.RequeueFilter{Kind: "email", All: true})
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
}

func TestForget(t *testing.T) {
	a, b := setup(t)
	ctx := context.Background()
	p := newPayments(t, b)
	p.deliver("acme", "pay_1", `{"amount":1}`)
	p.deliver("acme", "pay_1", `{"amount":1}`)
	require.EqualValues(t, 1, p.runs.Load(), "a duplicate")

	id := inbox.ID{Consumer: "payments", Tenant: "acme", Key: "pay_1"}
	k, err := a.Forget(ctx, id, admin.Audit{Who: "ann", Why: "INC-42: replay after the fix"})
	require.NoError(t, err)
	require.Equal(t, "completed", k.State)

	// The audit line.
	var line map[string]any
	require.NoError(t, json.Unmarshal([]byte(strings.TrimSpace(b.logs.String())), &line), b.logs.String())
	require.Equal(t, "WARN", line["level"])
	require.Contains(t, line["msg"], "forgotten")
	for field, want := range map[string]string{"schema": b.schema, "consumer": "payments", "tenant": "acme", "key": "pay_1",
		"state": "completed", "fingerprint": k.Fingerprint, "who": "ann", "why": "INC-42: replay after the fix"} {
		require.Equal(t, want, line[field], field)
	}

	// The next delivery runs the handler again; its effect is already there.
	p.deliver("acme", "pay_1", `{"amount":1}`)
	require.EqualValues(t, 2, p.runs.Load())
	require.Equal(t, 1, pgtest.Count(t, b.pool, `SELECT count(*) FROM effects WHERE key = 'receipt:pay_1'`))

	_, err = a.Forget(ctx, inbox.ID{Consumer: "payments", Tenant: "globex", Key: "pay_1"}, admin.Audit{})
	require.ErrorIs(t, err, admin.ErrNotFound)

	// A running lease is refused; a stale one may go.
	b.exec(t, `INSERT INTO inbox (consumer, tenant, key, fingerprint, state, lease_until, fence, expires_at) VALUES
		('mailer', '', 'live', '\x00', 'processing', now() + interval '1 minute', 1, now() + interval '1 day'),
		('mailer', '', 'stale', '\x00', 'processing', now() - interval '1 minute', 1, now() + interval '1 day')`)
	_, err = a.Forget(ctx, inbox.ID{Consumer: "mailer", Key: "live"}, admin.Audit{})
	require.ErrorIs(t, err, admin.ErrLeaseHeld)
	require.Equal(t, "lease_held", inbox.Code(err))
	require.Equal(t, 1, pgtest.Count(t, b.pool, `SELECT count(*) FROM inbox WHERE key = 'live'`))
	k, err = a.Forget(ctx, inbox.ID{Consumer: "mailer", Key: "stale"}, admin.Audit{})
	require.NoError(t, err)
	require.Equal(t, "processing", k.State)
	require.Equal(t, 2, strings.Count(b.logs.String(), `"level":"WARN"`), "two forgets, two audit lines")
	require.Contains(t, b.logs.String(), `"who":"unknown"`)
}

// Every read and action runs inside a caller's transaction too.
func TestInsideATransaction(t *testing.T) {
	_, b := setup(t)
	ctx := context.Background()
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	a, err := admin.New(admin.Config{Pool: tx, Schema: b.schema})
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `INSERT INTO effects (kind, key, fingerprint, state) VALUES ('email', 'r', '\x00', 'dead')`)
	require.NoError(t, err)
	require.NoError(t, a.Requeue(ctx, admin.EffectID{Kind: "email", Key: "r"}))
	require.NoError(t, tx.Rollback(ctx))
	require.Zero(t, pgtest.Count(t, b.pool, `SELECT count(*) FROM effects`))
}
