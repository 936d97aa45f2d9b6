package main

import (
	"context"
	"encoding/json"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/internal/pgtest"
)

// idemOn runs the CLI with a terminal that types input.
func (b *bundle) idemOn(input string, args ...string) result {
	b.t.Helper()
	args = append(args, "--database-url", pgtest.URL(), "--schema", b.schema)
	var out, errOut strings.Builder
	code := runOn(context.Background(), args, strings.NewReader(input), &out, &errOut)
	return result{code: code, stdout: out.String(), stderr: errOut.String()}
}

func TestForgetCLI(t *testing.T) {
	b := setup(t)
	b.process("acme", "pay-1", `{}`)
	b.process("acme", "pay-2", "bad")
	count := func() int {
		return pgtest.Count(t, b.pool, `SELECT count(*) FROM inbox WHERE consumer = 'payments' AND tenant = 'acme' AND key = 'pay-1'`)
	}

	// No --reason, no yes: nothing changes.
	r := b.idem("forget", "--consumer", "payments", "--tenant", "acme", "--key", "pay-1")
	require.Equal(t, exitUsage, r.code)
	require.Contains(t, r.stderr, "--reason is required")
	r = b.idem("forget", "--consumer", "payments", "--tenant", "acme", "--key", "pay-1", "--reason", "test")
	require.Equal(t, exitUsage, r.code)
	require.Contains(t, r.stderr, "is completed")
	require.Contains(t, r.stderr, "may commit a second time")
	require.Contains(t, r.stderr, "nothing was changed")
	require.Equal(t, 1, count())
	// A wrong answer on the terminal cancels.
	r = b.idemOn("pay-2\n", "forget", "--consumer", "payments", "--tenant", "acme", "--key", "pay-1", "--reason", "test")
	require.Equal(t, exitFailure, r.code)
	require.Contains(t, r.stderr, "cancelled; nothing was changed")
	require.Equal(t, 1, count())
	// The key typed on the terminal forgets it, with the audit line on stderr.
	r = b.idemOn("pay-1\n", "forget", "--consumer", "payments", "--tenant", "acme", "--key", "pay-1", "--reason", "INC-7 replay", "--by", "ann")
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Contains(t, r.stdout, `forgot inbox key "pay-1" of consumer "payments", tenant "acme" (it was completed)`)
	require.Regexp(t, `level=WARN msg="idem: inbox key forgotten.*consumer=payments tenant=acme key=pay-1 state=completed .*who=ann why="INC-7 replay"`, r.stderr)
	require.Zero(t, count())
	// The message runs again (its receipt is the same effect: no new one).
	b.process("acme", "pay-1", `{}`)
	require.Equal(t, 1, count())
	require.Equal(t, 1, pgtest.Count(t, b.pool, `SELECT count(*) FROM effects WHERE key = 'receipt:acme:pay-1'`))

	// --yes and --json: the forgotten row as JSON, the audit line as JSON on stderr.
	r = b.idem("forget", "--consumer", "payments", "--tenant", "acme", "--key", "pay-2", "--reason", "fixed", "--yes", "--json")
	require.Equal(t, exitOK, r.code, r.stderr)
	var out struct {
		Forgotten admin.InboxKey `json:"forgotten"`
		By        string         `json:"by"`
		Reason    string         `json:"reason"`
	}
	r.decode(t, &out)
	require.Equal(t, "failed", out.Forgotten.State)
	require.Equal(t, "fixed", out.Reason)
	require.NotEmpty(t, out.By, "--by defaults to the user at the host")
	var audit map[string]any
	for _, line := range strings.Split(strings.TrimSpace(r.stderr), "\n") {
		if strings.HasPrefix(line, "{") {
			require.NoError(t, json.Unmarshal([]byte(line), &audit))
		}
	}
	require.Equal(t, "WARN", audit["level"])
	require.Equal(t, "pay-2", audit["key"])

	r = b.idem("forget", "--consumer", "payments", "--tenant", "acme", "--key", "pay-2", "--reason", "again", "--yes", "--json")
	require.Equal(t, exitFailure, r.code)
	require.Equal(t, "not_found", decodeError(t, lastLine(r.stderr)).Code)

	// A key that begins with a space must be typed with it.
	_, err := b.pool.Exec(context.Background(), `INSERT INTO inbox (consumer, key, fingerprint, state, expires_at)
		VALUES ('mailer', ' spaced', '\x00', 'completed', now() + interval '1 day')`)
	require.NoError(t, err)
	spaced := func() int {
		return pgtest.Count(t, b.pool, `SELECT count(*) FROM inbox WHERE consumer = 'mailer' AND key = ' spaced'`)
	}
	r = b.idemOn("spaced\n", "forget", "--consumer", "mailer", "--key", " spaced", "--reason", "test")
	require.Equal(t, exitFailure, r.code, r.stderr)
	require.Contains(t, r.stderr, "Type the key ( spaced) to forget it, anything else to cancel: idem forget: cancelled; nothing was changed\n")
	require.Equal(t, 1, spaced())
	b.idemOn(" spaced\r\n", "forget", "--consumer", "mailer", "--key", " spaced", "--reason", "test").ok(t)
	require.Zero(t, spaced())

	// A key under a running lease is refused.
	_, err = b.pool.Exec(context.Background(), `INSERT INTO inbox (consumer, key, fingerprint, state, lease_until, fence, expires_at)
		VALUES ('mailer', 'live', '\x00', 'processing', now() + interval '1 minute', 1, now() + interval '1 day')`)
	require.NoError(t, err)
	r = b.idem("forget", "--consumer", "mailer", "--key", "live", "--reason", "stuck?", "--yes")
	require.Equal(t, exitFailure, r.code)
	require.Contains(t, r.stderr, "under a delivery's lease")
}

func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}

func TestInboxListAndFindCLI(t *testing.T) {
	b := setup(t)
	for _, k := range []string{"pay-1", "pay-2", "pay-3"} {
		b.process("acme", k, `{}`)
	}
	b.process("globex", "pay-1", "bad")

	r := b.idem("inbox", "list").ok(t)
	require.Regexp(t, `payments\s+acme\s+pay-1\s+completed`, r.stdout)
	require.Regexp(t, `payments\s+globex\s+pay-1\s+failed\s+.*permanent: card declined`, r.stdout)

	r = b.idem("inbox", "list", "--tenant", "acme", "--limit", "2").ok(t)
	require.Contains(t, r.stdout, "pay-2")
	require.NotContains(t, r.stdout, "pay-3")
	cursor := regexp.MustCompile(`next page: --after (\S+)\)`).FindStringSubmatch(r.stdout)
	require.NotNil(t, cursor, r.stdout)
	r = b.idem("inbox", "list", "--tenant", "acme", "--limit", "2", "--after", cursor[1]).ok(t)
	require.Contains(t, r.stdout, "pay-3")
	require.NotContains(t, r.stdout, "pay-1")
	require.NotContains(t, r.stdout, "next page")

	var keys []admin.InboxKey
	r = b.idem("inbox", "list", "--state", "failed", "--since", "1d", "--json").ok(t)
	r.decode(t, &keys)
	require.Len(t, keys, 1)
	require.Equal(t, "globex", keys[0].Tenant)
	r = b.idem("inbox", "list", "--until", "2000-01-01", "--json").ok(t)
	r.decode(t, &keys)
	require.Empty(t, keys)
	r = b.idem("inbox", "list", "--limit", "1", "--json").ok(t)
	require.Contains(t, r.stderr, "next page: --after ")
	require.Equal(t, exitUsage, b.idem("inbox", "list", "--state", "dead").code)
	require.Equal(t, exitUsage, b.idem("inbox", "list", "--since", "yesterday").code)

	r = b.idem("find", "--key", "pay-1").ok(t)
	require.Contains(t, r.stdout, `Inbox keys "pay-1": 2`)
	require.Contains(t, r.stdout, `Effects with key "pay-1": 0`)
	var found admin.Found
	b.idem("find", "--key", "receipt:acme:pay-1", "--json").ok(t).decode(t, &found)
	require.Len(t, found.Effects, 1)
	require.Equal(t, "acme", found.Effects[0].Tenant)
	b.idem("find", "--key", "pay-1", "--tenant", "globex", "--json").ok(t).decode(t, &found)
	require.Len(t, found.Inbox, 1)
	require.Equal(t, "failed", found.Inbox[0].State)
}

func TestEffectsListPagesAndTenants(t *testing.T) {
	b := setup(t)
	_, err := b.pool.Exec(context.Background(), `INSERT INTO effects (tenant, kind, key, fingerprint, state, attempts, in_flight, last_error, created_at, next_attempt_at) VALUES
		('', 'email', 'r1', '\x00', 'dead', 25, false, E'boom\x1b[2J', now() - interval '3 days', now()),
		('acme', 'email', 'r1', '\x00', 'dead', 25, false, 'boom', now(), now()),
		('globex', 'email', 'r1', '\x00', 'dead', 25, false, 'boom', now(), now()),
		('acme', 'email', 'r2', '\x00', 'pending', 1, true, NULL, now(), now() - interval '1 minute')`)
	require.NoError(t, err)

	r := b.idem("effects", "list").ok(t)
	require.Regexp(t, `TENANT\s+KIND\s+KEY`, r.stdout)
	require.Regexp(t, `-\s+email\s+r1\s+dead`, r.stdout, "the unscoped tenant shows as -")
	require.Regexp(t, `acme\s+email\s+r1\s+dead`, r.stdout)
	require.Contains(t, r.stdout, `boom\x1b[2J`, "a terminal escape in an error is shown, not sent to the terminal")
	require.NotContains(t, r.stdout, "\x1b")

	var list []admin.Effect
	b.idem("effects", "list", "--tenant", "", "--json").ok(t).decode(t, &list)
	require.Len(t, list, 1)
	require.Equal(t, "", list[0].Tenant)
	b.idem("effects", "list", "--since", "1d", "--json").ok(t).decode(t, &list)
	require.Len(t, list, 2)

	r = b.idem("effects", "list", "--limit", "2").ok(t)
	cursor := regexp.MustCompile(`next page: --after (\S+)\)`).FindStringSubmatch(r.stdout)
	require.NotNil(t, cursor, r.stdout)
	b.idem("effects", "list", "--limit", "2", "--after", cursor[1], "--json").ok(t).decode(t, &list)
	require.Len(t, list, 1)
	require.Equal(t, "globex", list[0].Tenant)
	r = b.idem("effects", "list", "--after", "garbage")
	require.Equal(t, exitUsage, r.code)
	require.Contains(t, r.stderr, "page cursor")

	r = b.idem("effects", "list", "--stuck").ok(t)
	require.Regexp(t, `acme\s+email\s+r2\s+pending`, r.stdout)
	require.Contains(t, r.stdout, "acme:email/r2: lease ran out")
	require.Equal(t, exitUsage, b.idem("effects", "list", "--stuck", "--state", "dead").code)
	b.idem("effects", "list", "--state", "all", "--json").ok(t).decode(t, &list)
	require.Len(t, list, 4)

	// Requeue by tenant: '' is the unscoped effect alone; no --tenant is every tenant.
	r = b.idem("effects", "requeue", "--kind", "email", "--key", "r1", "--tenant", "").ok(t)
	require.Contains(t, r.stdout, "requeued 1 dead email effect")
	require.Equal(t, "dead", stateOfEffect(t, b, "acme", "email", "r1"))
	r = b.idem("effects", "requeue", "--kind", "email", "--key", "r1", "--tenant", "")
	require.Equal(t, exitFailure, r.code)
	require.Contains(t, r.stderr, "effect email/r1 is pending, not dead")
	var out map[string]any
	b.idem("effects", "requeue", "--kind", "email", "--key", "r1", "--json").ok(t).decode(t, &out)
	require.EqualValues(t, 2, out["requeued"], "acme's and globex's")
	r = b.idem("effects", "requeue", "--kind", "email", "--key", "r2", "--tenant", "globex")
	require.Equal(t, exitFailure, r.code)
	require.Contains(t, r.stderr, `no effect of kind "email" with key "r2" in tenant "globex"`)
}
