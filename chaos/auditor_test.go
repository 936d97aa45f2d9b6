package chaos_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/chaos"
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
	sum := chaos.Sum("all shards", rep, ok)
	require.Equal(t, "all shards", sum.Consumer)
	require.Equal(t, [4]int{8, 5, 1, 1}, [4]int{sum.Messages, sum.CommittedOnce, sum.CommittedTwice, sum.Lost})
	require.Equal(t, []string{"lost"}, sum.LostKeys)
	require.Equal(t, [2]int{2, 3}, [2]int{sum.EffectsMissing, sum.SendsMissing})
	require.EqualValues(t, 5+q.Deliveries, sum.Deliveries)
	require.False(t, sum.OK())
	require.ErrorContains(t, sum.Err(), "1 lost")
	require.EqualValues(t, -1, chaos.Sum("x", rep, chaos.Report{Deliveries: -1}).Deliveries)
	require.True(t, chaos.Sum("x", ok, ok).OK())

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
	table := chaos.FormatReports([]string{"idem", "other"}, idem, unmeasured)
	require.Regexp(t, `(?m)^duplicates delivered +155 +-$`, table)
}
