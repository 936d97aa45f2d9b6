package main

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/migrate"
)

// bundle runs the CLI in-process against one test schema.
type bundle struct {
	t      *testing.T
	pool   *pgxpool.Pool
	schema string
	// url is the database the CLI is pointed at (pgtest.URL() when empty).
	url string
}

// dbURL is the database the CLI is pointed at.
func (b *bundle) dbURL() string { return cmp.Or(b.url, pgtest.URL()) }

func setup(t *testing.T, opts ...pgtest.Options) *bundle {
	t.Helper()
	t.Parallel()
	pool, schema := pgtest.Setup(t, append(opts, pgtest.Options{MaxConns: 4})[0])
	return &bundle{t: t, pool: pool, schema: schema}
}

type result struct {
	code           int
	stdout, stderr string
}

// idem runs the CLI with the test database and schema appended to args.
func (b *bundle) idem(args ...string) result {
	b.t.Helper()
	args = append(args, "--database-url", b.dbURL(), "--schema", b.schema)
	return runCLI(b.t, args...)
}

func runCLI(t *testing.T, args ...string) result {
	t.Helper()
	var out, errOut bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	code := run(ctx, args, &out, &errOut)
	return result{code: code, stdout: out.String(), stderr: errOut.String()}
}

func (r result) ok(t *testing.T) result {
	t.Helper()
	require.Equal(t, exitOK, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
	return r
}

func (r result) decode(t *testing.T, v any) {
	t.Helper()
	require.NoError(t, json.Unmarshal([]byte(r.stdout), v), r.stdout)
}

func TestHelpOnEveryCommandShowsAnExample(t *testing.T) {
	t.Parallel()
	for _, c := range commands {
		for _, flag := range []string{"--help", "-h"} {
			r := runCLI(t, append(strings.Fields(c.name), flag)...).ok(t)
			require.Contains(t, r.stdout, "Example:\n  idem "+c.name, c.name)
			if !c.offline {
				require.Contains(t, r.stdout, "--database-url")
			}
			require.Contains(t, r.stdout, "--json")
			require.Empty(t, r.stderr)
		}
	}
	r := runCLI(t, "--help").ok(t)
	for _, c := range commands {
		require.Contains(t, r.stdout, c.name)
	}
	require.Contains(t, runCLI(t, "help", "gc").ok(t).stdout, "Example:\n  idem gc")
	require.Contains(t, runCLI(t, "effects", "--help").ok(t).stdout, "list, requeue")
	require.Contains(t, runCLI(t, "help", "effects", "requeue").ok(t).stdout, "Example:\n  idem effects requeue")
}

func TestBadUsageExitsTwo(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		{},
		{"frobnicate"},
		{"effects"},
		{"effects", "frob"},
		{"migrate", "sideways"},
		{"migrate", "up", "down"},
		{"migrate", "--no-such-flag"},
		{"stats", "extra"},
		{"stats", "--schema", "Bad-Schema"},
		{"inspect", "--key", "k"},
		{"inspect", "--consumer", "c"},
		{"effects", "list", "--state", "weird"},
		{"effects", "list", "--limit", "0"},
		{"inbox", "list", "--limit", "0"},
		{"failures", "--limit", "100000"},
		{"effects", "requeue", "--key", "k"},
		{"effects", "requeue", "--kind", "email"},
		{"effects", "requeue", "--kind", "email", "--key", "k", "--all-dead"},
		{"effects", "requeue", "--kind", "bad kind!", "--all-dead"},
		{"gc", "--batch-size", "0"},
		{"gc", "--pause", "soon"},
	} {
		r := runCLI(t, args...)
		require.Equal(t, exitUsage, r.code, "%q: %s", args, r.stderr)
		require.NotEmpty(t, r.stderr, "%q", args)
		require.Empty(t, r.stdout, "%q", args)
	}
}

func TestFailuresSayWhatToDo(t *testing.T) {
	b := setup(t, pgtest.Options{NoMigrate: true})
	r := runCLI(t, "stats", "--database-url", "postgres://postgres@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=2")
	require.Equal(t, exitNoPostgres, r.code)
	require.Contains(t, r.stderr, "cannot connect to Postgres at 127.0.0.1:1")
	require.Contains(t, r.stderr, "docker compose up -d postgres")

	r = runCLI(t, "stats", "--database-url", "postgres://u:s3cret@host:notaport/db")
	require.Equal(t, exitUsage, r.code, "a DSN that does not parse is bad usage")
	require.Contains(t, r.stderr, "A DSN looks like postgres://")
	require.NotContains(t, r.stderr, "s3cret", "the password is never echoed")

	for _, args := range [][]string{
		{"stats"},
		{"gc"},
		{"inspect", "--consumer", "c", "--key", "k"},
		{"effects", "list"},
		{"effects", "requeue", "--kind", "email", "--all-dead"},
	} {
		r := b.idem(args...)
		require.Equal(t, exitFailure, r.code, "%q", args)
		require.Contains(t, r.stderr, "idem migrate up --schema "+b.schema, "%q", args)
	}
}

func TestMigrate(t *testing.T) {
	b := setup(t, pgtest.Options{NoMigrate: true})
	r := b.idem("migrate", "list").ok(t)
	require.Regexp(t, `001\s+core\s+no\s+-`, r.stdout)

	all := migrate.Migrations()
	var applied string
	var versions []any
	for _, m := range all {
		applied += fmt.Sprintf("applied %03d_%s to schema %s\n", m.Version, m.Name, b.schema)
		versions = append(versions, float64(m.Version))
	}
	r = b.idem("migrate", "up").ok(t)
	require.Equal(t, applied, r.stdout)
	require.Equal(t, "schema "+b.schema+" is up to date\n", b.idem("migrate").ok(t).stdout)

	var list []migrationJSON
	b.idem("migrate", "list", "--json").ok(t).decode(t, &list)
	require.Len(t, list, len(all))
	require.True(t, list[0].Applied)
	require.NotNil(t, list[0].AppliedAt)

	for v := len(all); v >= 1; v-- {
		var down map[string]any
		b.idem("migrate", "down", "--yes", "--json").ok(t).decode(t, &down)
		require.EqualValues(t, v, down["reverted"])
	}
	require.Zero(t, pgtest.Count(t, b.pool, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'inbox'`, b.schema))
	require.Contains(t, b.idem("migrate", "down", "--yes").ok(t).stdout, "no migration to revert")

	var up map[string]any
	b.idem("migrate", "up", "--json").ok(t).decode(t, &up)
	require.Equal(t, versions, up["applied"])
}

// process runs one message through a real consumer with a tenant scope; the
// handler makes an email effect, and fails permanently when the payload says so.
func (b *bundle) process(tenant, key, payload string) {
	b.t.Helper()
	c, err := consumer.New(consumer.Config{
		Name: "payments", Pool: b.pool, Schema: b.schema,
		Tenant: consumer.MetadataKey("tenant"),
	})
	require.NoError(b.t, err)
	h := c.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if string(msg.Payload) == "bad" {
			return nil, consumer.Permanent(errBadPayment)
		}
		ctx := msg.Context()
		_, err := effects.Enqueue(ctx, consumer.Tx(ctx), effects.Effect{
			Kind: "email", Key: "receipt:" + tenant + ":" + msg.UUID, Payload: msg.Payload,
		})
		return nil, err
	})
	msg := message.NewMessage(key, []byte(payload))
	msg.Metadata.Set("tenant", tenant)
	_, err = h(msg)
	require.NoError(b.t, err)
}

var errBadPayment = consumer.Permanent(errString("card declined"))

type errString string

func (e errString) Error() string { return string(e) }

func TestInspectAndTenantScope(t *testing.T) {
	b := setup(t)
	b.process("acme", "pay-1", `{"amount":10}`)
	b.process("globex", "pay-1", `{"amount":99}`) // same key, other tenant: its own operation
	b.process("acme", "pay-2", "bad")

	r := b.idem("inspect", "--consumer", "payments", "--tenant", "acme", "--key", "pay-1").ok(t)
	require.Regexp(t, `state\s+completed`, r.stdout)
	require.Regexp(t, `tenant\s+acme`, r.stdout)
	require.Regexp(t, `fingerprint\s+[0-9a-f]{64}`, r.stdout)
	require.Contains(t, r.stdout, "Effects made by this message: 1")
	require.Regexp(t, `email\s+receipt:acme:pay-1\s+pending\s+0/25`, r.stdout)
	require.NotContains(t, r.stdout, "globex")

	var rec admin.Inspection
	b.idem("inspect", "--consumer", "payments", "--tenant", "globex", "--key", "pay-1", "--json").ok(t).decode(t, &rec)
	require.Equal(t, "globex", rec.Tenant)
	require.Equal(t, "completed", rec.State)
	require.Len(t, rec.Effects, 1)
	require.Equal(t, "receipt:globex:pay-1", rec.Effects[0].Key)
	require.Equal(t, "globex", rec.Effects[0].SourceTenant)
	require.True(t, rec.ExpiresAt.After(rec.ReceivedAt.Add(6*24*time.Hour)))

	b.idem("inspect", "--consumer", "payments", "--tenant", "acme", "--key", "pay-2", "--json").ok(t).decode(t, &rec)
	require.Equal(t, "failed", rec.State)
	require.Equal(t, "permanent", rec.ErrorCode)
	require.Contains(t, rec.Error, "card declined")
	require.Empty(t, rec.Effects, "a failed message's effects rolled back")

	// One tenant cannot read another's record: pay-2 exists only for acme, and no
	// tenant (or the empty tenant) is a scope of its own.
	for _, tenant := range []string{"globex", ""} {
		r = b.idem("inspect", "--consumer", "payments", "--tenant", tenant, "--key", "pay-2")
		require.Equal(t, exitFailure, r.code)
		require.Contains(t, r.stderr, "no inbox record")
		require.Empty(t, r.stdout)
	}
}

func TestStats(t *testing.T) {
	b := setup(t)
	b.process("acme", "pay-1", `{}`)
	b.process("acme", "pay-2", `{}`)
	b.process("acme", "pay-3", "bad")
	ctx := context.Background()
	_, err := b.pool.Exec(ctx, `INSERT INTO effects (kind, key, fingerprint, state, created_at, next_attempt_at) VALUES
		('sms', 'late', '\x00', 'pending', now() - interval '2 hours', now() + interval '1 hour'),
		('sms', 'due', '\x00', 'pending', now() - interval '1 hour', now() - interval '1 minute'),
		('sms', 'dead', '\x00', 'dead', now(), now()),
		('sms', 'done', '\x00', 'done', now(), now())`)
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `INSERT INTO inbox (consumer, key, fingerprint, state, expires_at)
		VALUES ('billing', 'old', '\x00', 'completed', now() - interval '1 s')`)
	require.NoError(t, err)

	var s admin.Stats
	b.idem("stats", "--json").ok(t).decode(t, &s)
	require.Equal(t, []admin.ConsumerStats{
		{Consumer: "billing", Rows: 1, Completed: 1, Expired: 1},
		{Consumer: "payments", Rows: 3, Completed: 2, Failed: 1},
	}, clearOldest(s.Consumers))
	require.Len(t, s.Effects, 2)
	email, sms := s.Effects[0], s.Effects[1]
	require.Equal(t, admin.KindStats{Kind: "email", Pending: 2, Due: 2}, withoutAge(email))
	require.Less(t, email.OldestPendingSeconds, 60.0)
	require.Equal(t, admin.KindStats{Kind: "sms", Pending: 2, Due: 1, Dead: 1, Done: 1, Stuck: 1}, withoutAge(sms))
	require.InDelta(t, 7200, sms.OldestPendingSeconds, 60)

	r := b.idem("stats").ok(t)
	require.Regexp(t, `payments\s+3\s+2\s+1\s+0\s+0`, r.stdout)
	require.Regexp(t, `sms\s+2\s+1\s+1\s+1\s+2h0m`, r.stdout)
}

func clearOldest(cs []admin.ConsumerStats) []admin.ConsumerStats {
	for i := range cs {
		cs[i].Oldest, cs[i].OldestProcessingSeconds = nil, 0
	}
	return cs
}

func withoutAge(k admin.KindStats) admin.KindStats { k.OldestPendingSeconds = 0; return k }

func TestGC(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	_, err := b.pool.Exec(ctx, `INSERT INTO inbox (consumer, key, fingerprint, state, expires_at)
		SELECT 'c', 'k' || i, '\x00', CASE WHEN i % 10 = 0 THEN 'processing' ELSE 'completed' END, now() - interval '1 s'
		FROM generate_series(1, 250) i`)
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `INSERT INTO effects (kind, key, fingerprint, state, done_at)
		SELECT 'email', 'e' || i, '\x00', 'done', now() - (i || ' hours')::interval FROM generate_series(1, 100) i`)
	require.NoError(t, err)

	var out gcJSON
	b.idem("gc", "--batch-size", "40", "--effects-retention", "47h30m", "--json").ok(t).decode(t, &out)
	require.EqualValues(t, 225, out.InboxDeleted)
	require.EqualValues(t, 53, out.EffectsDeleted) // done 48..100 hours ago
	require.Equal(t, 8, out.Batches)               // 225 = 5*40+25 inbox, 53 = 40+13 effects

	r := b.idem("gc").ok(t)
	require.True(t, strings.HasPrefix(r.stdout, "deleted 0 expired inbox rows and 0 done effects from schema "+b.schema+" in "), r.stdout)
	require.Equal(t, 25, pgtest.Count(t, b.pool, `SELECT count(*) FROM inbox WHERE state = 'processing'`))
}

func TestEffectsListAndRequeue(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	_, err := b.pool.Exec(ctx, `INSERT INTO effects (kind, key, fingerprint, state, attempts, last_error, created_at) VALUES
		('email', 'receipt:1', '\x00', 'dead', 25, 'smtp: 550 mailbox unavailable', now() - interval '3 minutes'),
		('email', 'receipt:2', '\x00', 'dead', 25, 'smtp: 550 mailbox unavailable', now() - interval '2 minutes'),
		('email', 'receipt:3', '\x00', 'pending', 1, NULL, now()),
		('sms', 'text:1', '\x00', 'dead', 3, 'bad number', now() - interval '1 minute')`)
	require.NoError(t, err)

	r := b.idem("effects", "list").ok(t)
	require.Regexp(t, `email\s+receipt:1\s+dead\s+25/25`, r.stdout)
	require.Contains(t, r.stdout, "smtp: 550 mailbox unavailable")
	require.Contains(t, r.stdout, "text:1")
	require.NotContains(t, r.stdout, "receipt:3")

	var list []admin.Effect
	b.idem("effects", "list", "--state", "dead", "--kind", "email", "--limit", "1", "--json").ok(t).decode(t, &list)
	require.Len(t, list, 1)
	require.Equal(t, "receipt:1", list[0].Key)
	require.Equal(t, "smtp: 550 mailbox unavailable", list[0].LastError)

	// One key.
	r = b.idem("effects", "requeue", "--kind", "email", "--key", "receipt:1").ok(t)
	require.Contains(t, r.stdout, "requeued 1 dead email effect")
	var state string
	var attempts int
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT state, attempts FROM effects WHERE key = 'receipt:1'`).Scan(&state, &attempts))
	require.Equal(t, "pending", state)
	require.Zero(t, attempts)

	// Requeueing it again, or a live one, or a typo, says why nothing happened.
	r = b.idem("effects", "requeue", "--kind", "email", "--key", "receipt:1")
	require.Equal(t, exitFailure, r.code)
	require.Contains(t, r.stderr, "is pending, not dead")
	r = b.idem("effects", "requeue", "--kind", "email", "--key", "receipt:nope")
	require.Equal(t, exitFailure, r.code)
	require.Contains(t, r.stderr, `no effect of kind "email" with key "receipt:nope"`)

	// All dead of a kind: the sms one stays dead.
	var out map[string]any
	b.idem("effects", "requeue", "--kind", "email", "--all-dead", "--json").ok(t).decode(t, &out)
	require.EqualValues(t, 1, out["requeued"])
	require.Equal(t, 1, pgtest.Count(t, b.pool, `SELECT count(*) FROM effects WHERE state = 'dead'`))
	require.Contains(t, b.idem("effects", "requeue", "--kind", "email", "--all-dead").ok(t).stdout, "nothing to requeue")
	require.Contains(t, b.idem("effects", "list", "--kind", "email").ok(t).stdout, "no dead email effects")
}
