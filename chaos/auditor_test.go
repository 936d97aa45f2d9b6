package chaos_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/chaos"
	"github.com/idemkit/idem/internal/errcode"
)

func TestAuditorRejectsBadSchema(t *testing.T) {
	for _, s := range []string{`x"; DROP TABLE inbox; --`, "Upper", "1abc"} {
		_, err := chaos.NewAuditor(chaos.AuditorConfig{Pool: nil, Schema: s})
		require.Error(t, err, s)
	}
	pool, _ := setupPayments(t, 2)
	for _, s := range []string{`x"; DROP TABLE inbox; --`, "Upper", "1abc"} {
		_, err := chaos.NewAuditor(chaos.AuditorConfig{Pool: pool, Schema: s})
		require.ErrorContains(t, err, "invalid config", s)
	}
}

// TestAuditorJudgesEachKey builds a database by hand: one key committed once, one
// twice, one recorded as failed, one lost, one whose effect row is missing, one
// never sent, and one unexpected.
func TestAuditorJudgesEachKey(t *testing.T) {
	t.Parallel()
	pool, schema := setupPayments(t, 2)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `
INSERT INTO inbox (consumer, key, fingerprint, state, expires_at) VALUES
  ('payments', 'once', '\x00', 'completed', now() + interval '1 day'),
  ('payments', 'twice', '\x00', 'completed', now() + interval '1 day'),
  ('payments', 'failed', '\x00', 'failed', now() + interval '1 day'),
  ('payments', 'noeffect', '\x00', 'completed', now() + interval '1 day'),
  ('payments', 'unsent', '\x00', 'completed', now() + interval '1 day'),
  ('other', 'lost', '\x00', 'completed', now() + interval '1 day');
INSERT INTO ledger (key, payload) VALUES ('once', ''), ('twice', ''), ('twice', ''), ('noeffect', ''), ('unsent', ''), ('stray', '');
INSERT INTO effects (kind, key, fingerprint, state, source_consumer, source_tenant, source_key) VALUES
  ('email', 'receipt:once', '\x00', 'done', 'payments', '', 'once'),
  ('email', 'receipt:twice', '\x00', 'done', 'payments', '', 'twice'),
  ('email', 'receipt:unsent', '\x00', 'done', 'payments', '', 'unsent'),
  ('email', 'receipt:pending', '\x00', 'pending', 'payments', '', 'pending');
INSERT INTO emails (effect_key) VALUES ('receipt:once'), ('receipt:twice'), ('receipt:twice');`)
	require.NoError(t, err)

	a, err := chaos.NewAuditor(chaos.AuditorConfig{Pool: pool, Schema: schema})
	require.NoError(t, err)
	q := withSends(auditQuery(idemTransactional, []string{"once", "twice", "failed", "lost", "noeffect", "unsent"}, 10, 4), pool)
	rep, err := a.Report(ctx, q)
	require.NoError(t, err)
	t.Logf("\n%s", rep)
	require.Equal(t, 6, rep.Messages)
	require.Equal(t, 3, rep.CommittedOnce) // once, noeffect, unsent
	require.Equal(t, 1, rep.CommittedTwice)
	require.Equal(t, []string{"twice"}, rep.DuplicatedKeys)
	require.Equal(t, 1, rep.Failed)
	require.Equal(t, 1, rep.Lost)
	require.Equal(t, []string{"lost"}, rep.LostKeys)
	require.Equal(t, 1, rep.Unexpected)
	require.Equal(t, [3]int{4, 1, 0}, [3]int{rep.InboxCompleted, rep.InboxFailed, rep.InboxProcessing})
	require.Equal(t, [3]int{3, 0, 1}, [3]int{rep.EffectsDone, rep.EffectsDead, rep.EffectsPending})
	require.Equal(t, 2, rep.EffectsMissing) // lost, noeffect
	require.Equal(t, 1, rep.SendsOnce)
	require.Equal(t, 1, rep.SendsRepeated)
	require.Equal(t, 3, rep.SendsMissing) // lost, noeffect (no row) and unsent (done, never received)
	require.False(t, rep.OK())
	require.False(t, rep.Settled())
	for _, want := range []string{"1 lost", "1 committed more than once", "2 effects missing", "3 effects never received"} {
		require.ErrorContains(t, rep.Err(), want)
	}
	require.Contains(t, rep.String(), "FAIL")

	// Reports of disjoint key sets (the shards of a run) add up, failures and all;
	// a report whose deliveries were not measured leaves the sum unmeasured.
	ok := chaos.Report{Consumer: "payments", Messages: 2, CommittedOnce: 2, Deliveries: 5, DuplicatesSuppressed: 3}
	sum := chaos.Report{Consumer: "all shards"}.Add(rep, ok)
	require.Equal(t, "all shards", sum.Consumer)
	require.Equal(t, [4]int{8, 5, 1, 1}, [4]int{sum.Messages, sum.CommittedOnce, sum.CommittedTwice, sum.Lost})
	require.Equal(t, []string{"lost"}, sum.LostKeys)
	require.Equal(t, [2]int{2, 3}, [2]int{sum.EffectsMissing, sum.SendsMissing})
	require.EqualValues(t, 5+q.Deliveries, sum.Deliveries)
	require.False(t, sum.OK())
	require.ErrorContains(t, sum.Err(), "1 lost")
	require.EqualValues(t, -1, chaos.Report{Consumer: "x"}.Add(rep, chaos.Report{Deliveries: -1}).Deliveries)
	require.True(t, chaos.Report{Consumer: "x"}.Add(ok, ok).OK())

	// Without a business count the inbox stands in for it.
	q.BusinessSQL = ""
	rep, err = a.Report(ctx, q)
	require.NoError(t, err)
	require.Equal(t, 4, rep.CommittedOnce)
	require.Zero(t, rep.CommittedTwice)

	_, err = a.Report(ctx, chaos.AuditQuery{Consumer: "payments", BusinessSQL: "x", BusinessCount: func(context.Context) (map[string]int, error) { return nil, nil }})
	require.Error(t, err)
}

// Effect keys are scoped by tenant (DESIGN.md, "Data model"): another tenant's
// effect with the same kind and key must not stand in for this tenant's missing
// one, or a lost effect would pass the audit.
func TestAuditorScopesEffectsByTenant(t *testing.T) {
	t.Parallel()
	pool, schema := setupPayments(t, 2)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `
INSERT INTO inbox (consumer, tenant, key, fingerprint, state, expires_at) VALUES
  ('payments', 'acme', 'p1', '\x00', 'completed', now() + interval '1 day'),
  ('payments', 'globex', 'p1', '\x00', 'completed', now() + interval '1 day');
INSERT INTO ledger (key, payload) VALUES ('p1', '');
INSERT INTO effects (tenant, kind, key, fingerprint, state, source_consumer, source_tenant, source_key) VALUES
  ('globex', 'email', 'receipt:p1', '\x00', 'done', 'payments', 'globex', 'p1');`)
	require.NoError(t, err)

	a, err := chaos.NewAuditor(chaos.AuditorConfig{Pool: pool, Schema: schema})
	require.NoError(t, err)
	q := auditQuery(idemTransactional, []string{"p1"}, 1, 0)
	q.Tenant = "acme"
	rep, err := a.Report(ctx, q)
	require.NoError(t, err)
	t.Logf("\n%s", rep)
	require.Equal(t, 1, rep.EffectsMissing, "globex's receipt:p1 is not acme's")

	q.Tenant = "globex"
	rep, err = a.Report(ctx, q)
	require.NoError(t, err)
	require.Zero(t, rep.EffectsMissing)
	require.Equal(t, 1, rep.EffectsDone)
}

// The table says how many deliveries went beyond one per message: the duplicates
// that reached the consumer, which it had to recognise.
func TestReportDuplicatesDelivered(t *testing.T) {
	idem := chaos.Report{Consumer: "idem", Messages: 300, Deliveries: 455, DuplicatesSuppressed: 142}
	require.EqualValues(t, 155, idem.DuplicatesDelivered())
	unmeasured := chaos.Report{Consumer: "other", Messages: 300, Deliveries: -1}
	require.EqualValues(t, -1, unmeasured.DuplicatesDelivered())
	table := idem.Beside(unmeasured)
	require.Regexp(t, `(?m)^duplicates delivered +155 +-$`, table)
}

// writePayments writes, in tx, the rows an idem consumer commits for each key:
// the completed inbox row, the ledger row and the email effect, done.
func writePayments(ctx context.Context, t *testing.T, tx pgx.Tx, keys []string) {
	t.Helper()
	for _, sql := range []string{
		`INSERT INTO inbox (consumer, key, fingerprint, state, expires_at)
			SELECT 'payments', k, '\x00', 'completed', now() + interval '1 day' FROM unnest($1::text[]) AS k`,
		`INSERT INTO ledger (key, payload) SELECT k, '' FROM unnest($1::text[]) AS k`,
		`INSERT INTO effects (kind, key, fingerprint, state, source_consumer, source_tenant, source_key)
			SELECT 'email', 'receipt:' || k, '\x00', 'done', 'payments', '', k FROM unnest($1::text[]) AS k`,
	} {
		_, err := tx.Exec(ctx, sql, keys)
		require.NoError(t, err)
	}
}

// A report reads one snapshot: a consumer's transaction that commits after the
// report has read the inbox and before it reads the ledger is in none of the
// report's figures. Read in separate queries, the report said inbox 0/0/0 next
// to committed once 20, and OK.
func TestReportIsOneSnapshot(t *testing.T) {
	t.Parallel()
	pool, schema := setupPayments(t, 4)
	ctx := context.Background()
	keys := paymentKeys(20)
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	writePayments(ctx, t, tx, keys)

	a, err := chaos.NewAuditor(chaos.AuditorConfig{Pool: pool, Schema: schema})
	require.NoError(t, err)
	commits := 0
	chaos.SetBetweenReads(a, func() {
		if commits++; commits == 1 {
			require.NoError(t, tx.Commit(ctx))
		}
	})
	q := auditQuery(idemTransactional, keys, -1, -1)
	rep, err := a.Report(ctx, q)
	require.NoError(t, err)
	t.Logf("\n%s", rep)
	require.Equal(t, 1, commits, "the consumer committed between the report's reads")
	require.Equal(t, [3]int{0, 0, 0}, [3]int{rep.InboxCompleted, rep.InboxFailed, rep.InboxProcessing})
	require.Equal(t, [3]int{0, 0, 20}, [3]int{rep.CommittedOnce, rep.CommittedTwice, rep.Lost})
	require.Equal(t, [2]int{0, 20}, [2]int{rep.EffectsDone, rep.EffectsMissing})
	require.Zero(t, rep.Inconsistent)
	require.False(t, rep.OK())

	rep, err = a.Report(ctx, q)
	require.NoError(t, err)
	require.Equal(t, [3]int{20, 0, 0}, [3]int{rep.InboxCompleted, rep.InboxFailed, rep.InboxProcessing})
	require.Equal(t, [4]int{20, 0, 0, 20}, [4]int{rep.CommittedOnce, rep.Lost, rep.EffectsMissing, rep.EffectsDone})
	require.True(t, rep.OK(), "%v", rep.Err())

	// A transaction the caller gives the Auditor must be one snapshot itself.
	rc, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = rc.Rollback(ctx) }()
	inTx, err := chaos.NewAuditor(chaos.AuditorConfig{Pool: rc, Schema: schema})
	require.NoError(t, err)
	_, err = inTx.Report(ctx, q)
	require.ErrorIs(t, err, chaos.ErrNotOneSnapshot)
	require.Equal(t, "audit_not_one_snapshot", errcode.Code(err))
	rr, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	require.NoError(t, err)
	defer func() { _ = rr.Rollback(ctx) }()
	inTx, err = chaos.NewAuditor(chaos.AuditorConfig{Pool: rr, Schema: schema})
	require.NoError(t, err)
	rep, err = inTx.Report(ctx, q)
	require.NoError(t, err)
	require.Equal(t, [2]int{20, 20}, [2]int{rep.InboxCompleted, rep.CommittedOnce})
}

// Settled never accepts a report whose parts disagree. A BusinessCount reads
// another moment than the snapshot (here: ledger rows committed before the
// consumer's inbox rows, as with business rows on a database of their own), so
// the first reports see 20 commits and no inbox row: not OK, with the keys that
// disagree. Settled returns the first report whose parts agree.
func TestSettledRefusesPartsThatDisagree(t *testing.T) {
	t.Parallel()
	pool, schema := setupPayments(t, 4)
	ctx := context.Background()
	keys := paymentKeys(20)
	_, err := pool.Exec(ctx, `INSERT INTO ledger (key, payload) SELECT k, '' FROM unnest($1::text[]) AS k`, keys)
	require.NoError(t, err)

	calls := 0
	q := chaos.AuditQuery{
		Consumer: consumerName, ExpectedKeys: keys, Deliveries: -1, DuplicatesSuppressed: -1,
		BusinessCount: func(ctx context.Context) (map[string]int, error) {
			counts, err := keyCounts(ctx, pool, ledgerCounts)
			if calls++; calls == 3 { // the inbox rows commit after the count was read
				_, err := pool.Exec(ctx, `INSERT INTO inbox (consumer, key, fingerprint, state, expires_at)
					SELECT 'payments', k, '\x00', 'completed', now() + interval '1 day' FROM unnest($1::text[]) AS k`, keys)
				require.NoError(t, err)
			}
			return counts, err
		},
	}
	a, err := chaos.NewAuditor(chaos.AuditorConfig{Pool: pool, Schema: schema, SettlePoll: time.Millisecond})
	require.NoError(t, err)
	rep, err := a.Report(ctx, q)
	require.NoError(t, err)
	t.Logf("\n%s", rep)
	require.Equal(t, [3]int{0, 0, 0}, [3]int{rep.InboxCompleted, rep.InboxFailed, rep.InboxProcessing})
	require.Equal(t, [2]int{20, 0}, [2]int{rep.CommittedOnce, rep.Lost})
	require.Equal(t, 20, rep.Inconsistent)
	require.Len(t, rep.InconsistentKeys, 10)
	require.Equal(t, keys[0]+": committed 1, inbox row none", rep.InconsistentKeys[0])
	require.True(t, rep.Settled())
	require.False(t, rep.OK())
	require.ErrorContains(t, rep.Err(), "20 keys whose business commit, inbox row and effect row disagree")
	require.Regexp(t, `(?m)^parts disagree ! +20$`, rep.String())

	rep, err = a.Settled(ctx, q)
	require.NoError(t, err)
	require.Equal(t, 3, calls, "the second report disagreed too; the third agrees")
	require.Equal(t, [3]int{20, 0, 0}, [3]int{rep.InboxCompleted, rep.InboxFailed, rep.InboxProcessing})
	require.Equal(t, [3]int{20, 0, 0}, [3]int{rep.CommittedOnce, rep.Lost, rep.Inconsistent})
	require.True(t, rep.OK(), "%v", rep.Err())

	// A peer keeps no inbox: its commits are not checked against one.
	q.WithoutInbox = true
	_, err = pool.Exec(ctx, `DELETE FROM inbox`)
	require.NoError(t, err)
	rep, err = a.Report(ctx, q)
	require.NoError(t, err)
	require.Equal(t, [2]int{20, 0}, [2]int{rep.CommittedOnce, rep.Inconsistent})
	require.True(t, rep.OK(), "%v", rep.Err())
}

// A key that did not commit has no effect row: an effect of a message recorded
// as failed (whose writes were rolled back) is a disagreement, not a pass.
func TestReportRefusesAnEffectWithoutItsCommit(t *testing.T) {
	t.Parallel()
	pool, schema := setupPayments(t, 2)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `
INSERT INTO inbox (consumer, key, fingerprint, state, expires_at) VALUES
  ('payments', 'failed', '\x00', 'failed', now() + interval '1 day');
INSERT INTO effects (kind, key, fingerprint, state, source_consumer, source_tenant, source_key) VALUES
  ('email', 'receipt:failed', '\x00', 'done', 'payments', '', 'failed');`)
	require.NoError(t, err)
	a, err := chaos.NewAuditor(chaos.AuditorConfig{Pool: pool, Schema: schema})
	require.NoError(t, err)
	rep, err := a.Report(ctx, auditQuery(idemTransactional, []string{"failed"}, -1, -1))
	require.NoError(t, err)
	t.Logf("\n%s", rep)
	require.Equal(t, [3]int{1, 0, 1}, [3]int{rep.Failed, rep.Lost, rep.EffectsDone})
	require.Equal(t, 1, rep.Inconsistent)
	require.Equal(t, []string{"failed: not committed, effect receipt:failed done"}, rep.InconsistentKeys)
	require.False(t, rep.OK())
}
