package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/pgtest"
)

var (
	binOnce sync.Once
	binPath string
	binErr  error
)

// builtIdem builds the idem binary once for the package's tests.
func builtIdem(t *testing.T) string {
	t.Helper()
	binOnce.Do(func() {
		dir, err := os.MkdirTemp("", "idem-bin-")
		if err != nil {
			binErr = err
			return
		}
		binPath = filepath.Join(dir, "idem")
		out, err := exec.Command("go", "build", "-o", binPath, ".").CombinedOutput()
		if err != nil {
			binErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	require.NoError(t, binErr)
	return binPath
}

// bin runs the built binary with the test database and schema, stdin from
// /dev/null (no terminal), and returns what it did.
func (b *bundle) bin(args ...string) result {
	b.t.Helper()
	bin := builtIdem(b.t) // the first call builds it: the command's minute starts after
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, append(args, "--database-url", b.dbURL(), "--schema", b.schema)...)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	var ee *exec.ExitError
	code := 0
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else {
		require.NoError(b.t, err)
	}
	return result{code: code, stdout: out.String(), stderr: errOut.String()}
}

// seedFailures makes two groups: 4 failed payments keys (tenant acme) through a
// real consumer, and 3 dead email effects through a real Dispatcher.
func (b *bundle) seedFailures() {
	b.t.Helper()
	for i := range 4 {
		b.process("acme", fmt.Sprintf("pay_%d", i), "bad")
	}
	ctx := context.Background()
	tx, err := b.pool.Begin(ctx)
	require.NoError(b.t, err)
	for i := range 3 {
		_, err := effects.Enqueue(effects.WithScope(ctx, effects.Scope{Schema: b.schema}), tx, effects.Effect{Kind: "email", Key: fmt.Sprintf("receipt:%d", i), Payload: []byte(`{}`)})
		require.NoError(b.t, err)
	}
	require.NoError(b.t, tx.Commit(ctx))
	d, err := effects.NewDispatcher(effects.Config{Pool: b.pool, Schema: b.schema, PollInterval: 20 * time.Millisecond,
		Senders: map[string]effects.Sender{"email": effects.SenderFunc(func(_ context.Context, dl effects.Delivery) error {
			return effects.Permanent(fmt.Errorf("smtp 550: mailbox %q unavailable", dl.Key))
		})}})
	require.NoError(b.t, err)
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- d.Run(runCtx) }()
	pgtest.WaitFor(b.t, 20*time.Second, "3 dead effects", func() bool {
		var n int
		require.NoError(b.t, b.pool.QueryRow(ctx, `SELECT count(*) FROM effects WHERE state = 'dead'`).Scan(&n))
		return n == 3
	})
	stop()
	require.NoError(b.t, <-done)
}

// TestFailuresCLI drives the built binary through the whole repair: list the
// groups, show one, dry-run, refuse without --yes (with the plan in the JSON
// error), act with a note, see the audit trail, and repeat without effect.
func TestFailuresCLI(t *testing.T) {
	b := setup(t)
	b.seedFailures()

	var groups []admin.FailureGroup
	r := b.bin("failures", "--json").ok(t)
	r.decode(t, &groups)
	require.Len(t, groups, 2)
	inboxG, effG := groups[0], groups[1]
	require.Equal(t, "payments", inboxG.Consumer)
	require.Equal(t, int64(4), inboxG.Count)
	require.Equal(t, "permanent: permanent: card declined", inboxG.Masked) // errBadPayment wrapped twice
	require.Equal(t, `smtp <n>: mailbox "…" unavailable`, effG.Masked)

	// The table, with flags before the command too.
	r = b.bin("--json=false", "failures", "--order", "recent").ok(t)
	require.Contains(t, r.stdout, effG.ID)
	require.Contains(t, r.stdout, "permanent: card declined")
	r = b.bin("failures", "--kind", "email", "--json").ok(t)
	groups = nil
	r.decode(t, &groups)
	require.Len(t, groups, 1)

	// --code keeps the groups of that code, in JSON and in the table.
	require.Equal(t, "permanent", inboxG.Code)
	require.NotEqual(t, inboxG.Code, effG.Code)
	groups = nil
	b.bin("failures", "--code", inboxG.Code, "--json").ok(t).decode(t, &groups)
	require.Equal(t, []string{inboxG.ID}, []string{groups[0].ID}, "%v", groups)
	require.Len(t, groups, 1)
	r = b.bin("failures", "--code", inboxG.Code).ok(t)
	require.Contains(t, r.stdout, inboxG.ID)
	require.NotContains(t, r.stdout, effG.ID)
	r = b.bin("failures", "--code", "payment_declined").ok(t)
	require.Contains(t, r.stdout, "no failures")
	require.NotContains(t, r.stdout, inboxG.ID)
	r = b.bin("failures", "--code", "bad\xffcode", "--json")
	require.Equal(t, exitUsage, r.code, r.stderr)
	require.Contains(t, decodeError(t, r.stderr).Message, "error code")

	r = b.bin("failures", "show", effG.ID).ok(t)
	require.Contains(t, r.stdout, "Attempts made:\n  1 attempt(s): 3 effect(s)")
	require.Contains(t, r.stdout, "receipt:2")
	var shown admin.FailureGroup
	b.bin("failures", "show", inboxG.ID, "--json").ok(t).decode(t, &shown)
	require.Equal(t, "acme", shown.Tenant)
	require.Len(t, shown.SampleKeys, 4)

	// Wrong source and bad IDs are usage errors; a note is required.
	r = b.bin("failures", "release", effG.ID, "--note", "x", "--yes", "--json")
	require.Equal(t, exitFailure, r.code, r.stderr)
	require.Equal(t, "wrong_source", decodeError(t, r.stderr).Code)
	r = b.bin("failures", "show", "nope")
	require.Equal(t, exitUsage, r.code, r.stderr)
	r = b.bin("failures", "retry", effG.ID, "--yes", "--json")
	require.Equal(t, exitUsage, r.code)
	require.Contains(t, decodeError(t, r.stderr).Message, "--note is required")

	// Dry run: the plan, nothing changed.
	var plan admin.ActionResult
	b.bin("failures", "retry", effG.ID, "--dry-run", "--json").ok(t).decode(t, &plan)
	require.True(t, plan.DryRun)
	require.Equal(t, int64(3), plan.Rows)
	require.Equal(t, []string{"receipt:0", "receipt:1", "receipt:2"}, plan.Keys)
	r = b.bin("failures", "retry", effG.ID, "--dry-run").ok(t)
	require.Contains(t, r.stdout, "would requeue 3 dead effect(s)")

	// No --yes: refused, exit 2, the plan in the JSON error; nothing changed.
	r = b.bin("failures", "retry", effG.ID, "--note", "INC-42", "--json")
	require.Equal(t, exitUsage, r.code)
	ej := decodeError(t, r.stderr)
	require.Equal(t, codeConfirm, ej.Code)
	planJSON, _ := json.Marshal(ej.Plan)
	require.Contains(t, string(planJSON), `"rows":3`)
	r = b.bin("failures", "retry", effG.ID, "--note", "INC-42")
	require.Equal(t, exitUsage, r.code, "no terminal, no --yes: refused in text mode too")
	require.Contains(t, r.stderr, "will requeue 3 dead effect(s)")
	require.Equal(t, 3, countRows(t, b, `SELECT count(*) FROM effects WHERE state = 'dead'`))

	// Act, with the bound the operator saw.
	var res admin.ActionResult
	b.bin("failures", "retry", effG.ID, "--note", "INC-42: provider fixed", "--by", "alice", "--through", effG.LastSeen.Format(time.RFC3339Nano), "--yes", "--json").ok(t).decode(t, &res)
	require.Equal(t, int64(3), res.Rows)
	require.NotEmpty(t, res.ActionID)
	require.Equal(t, 3, countRows(t, b, `SELECT count(*) FROM effects WHERE state = 'pending' AND attempts = 0`))
	r = b.bin("failures", "release", inboxG.ID, "--note", "deploy 512 fixed it", "--yes").ok(t)
	require.Contains(t, r.stdout, "released 4 failed inbox key(s)")
	require.Zero(t, countRows(t, b, `SELECT count(*) FROM inbox WHERE state = 'failed'`))

	// Repeating changes nothing more, and says so.
	r = b.bin("failures", "retry", effG.ID, "--note", "again", "--yes").ok(t)
	require.Contains(t, r.stdout, "holds no failures now (last action: retry of 3 row(s) by alice")
	r = b.bin("failures", "retry", effG.ID, "--through", effG.LastSeen.Format(time.RFC3339Nano), "--note", "again", "--yes", "--json").ok(t)
	res = admin.ActionResult{}
	r.decode(t, &res)
	require.Zero(t, res.Rows)

	// The audit trail: show on an empty group lists the actions.
	r = b.bin("failures", "show", effG.ID).ok(t)
	require.Contains(t, r.stdout, "holds no failures now")
	require.Contains(t, r.stdout, "INC-42: provider fixed")
	require.Contains(t, r.stdout, "alice")

	// A well-formed ID that never existed is not found (exit 1).
	r = b.bin("failures", "discard", "e-0000000000000000", "--note", "x", "--yes", "--json")
	require.Equal(t, exitFailure, r.code)
	require.Equal(t, "not_found", decodeError(t, r.stderr).Code)
}

// TestFailuresAskOnTerminal: on a terminal, an action asks for "yes" and changes
// nothing on any other answer.
func TestFailuresAskOnTerminal(t *testing.T) {
	b := setup(t)
	b.seedFailures()
	var groups []admin.FailureGroup
	b.idem("failures", "--source", "effects", "--json").ok(t).decode(t, &groups)
	require.Len(t, groups, 1)
	ask := func(answer string) result {
		var out, errOut bytes.Buffer
		code := runOn(context.Background(), []string{"failures", "discard", groups[0].ID, "--note", "obsolete",
			"--database-url", pgtest.URL(), "--schema", b.schema}, strings.NewReader(answer), &out, &errOut)
		return result{code: code, stdout: out.String(), stderr: errOut.String()}
	}
	r := ask("no\n")
	require.Equal(t, exitFailure, r.code)
	require.Contains(t, r.stderr, "Type yes to discard these 3 row(s)")
	require.Contains(t, r.stderr, "cancelled; nothing was changed")
	require.Equal(t, 3, countRows(t, b, `SELECT count(*) FROM effects WHERE state = 'dead'`))
	r = ask("yes\n").ok(t)
	require.Contains(t, r.stdout, "discarded 3 dead effect(s)")
	require.Equal(t, 3, countRows(t, b, `SELECT count(*) FROM effects WHERE state = 'discarded'`))
}

func countRows(t *testing.T, b *bundle, sql string) int {
	t.Helper()
	var n int
	require.NoError(t, b.pool.QueryRow(context.Background(), sql).Scan(&n))
	return n
}

// TestFailuresRefusalPinsThePlan: refused for want of --yes, an action says how
// to run it again on the set it planned. A failure of the same group that
// arrives between the two runs is left out of the re-run.
func TestFailuresRefusalPinsThePlan(t *testing.T) {
	b := setup(t)
	b.seedFailures()
	var groups []admin.FailureGroup
	b.bin("failures", "--source", "inbox", "--json").ok(t).decode(t, &groups)
	require.Len(t, groups, 1)
	g := groups[0]

	r := b.bin("failures", "release", g.ID, "--note", "parser fixed", "--since", "1h")
	require.Equal(t, exitUsage, r.code, r.stderr)
	_, again, ok := strings.Cut(r.stderr, "run it again with ")
	require.True(t, ok, r.stderr)
	again = strings.TrimSpace(strings.SplitN(again, "\n", 2)[0])
	require.Contains(t, again, "--through "+g.LastSeen.UTC().Format(time.RFC3339Nano))
	require.Contains(t, again, "--since ", "an age is given back as a time")

	// A new failure of the group, after the plan was shown.
	b.process("acme", "pay_late", "bad")
	var now admin.FailureGroup
	b.bin("failures", "show", g.ID, "--json").ok(t).decode(t, &now)
	require.Equal(t, int64(5), now.Count, "the late failure is in the group")

	args := append([]string{"failures", "release", g.ID, "--note", "parser fixed", "--since", "1h"}, strings.Fields(again)...)
	r = b.bin(args...).ok(t)
	require.Contains(t, r.stdout, "released 4 failed inbox key(s)")
	require.Equal(t, 1, countRows(t, b, `SELECT count(*) FROM inbox WHERE state = 'failed' AND key = 'pay_late'`),
		"the failure that arrived after the plan is not released")
}
