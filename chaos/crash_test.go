package chaos_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/chaos"
	"github.com/idemkit/idem/internal/pgtest"
)

// TestCrashPointsKillTheProcess arms each crash point in a worker process, sees it
// die of SIGKILL at that point, checks what the database holds at that moment, and
// then lets a fresh process finish the job.
func TestCrashPointsKillTheProcess(t *testing.T) {
	t.Parallel()
	const key = "pay-00001"
	// feed runs one consumer process over one key and returns it, ended.
	feed := func(t *testing.T, schema, crash string) (*child, []childLine) {
		lines := make(chan childLine, 4)
		c := startChild(t, 1, "consumer", schema, idemTransactional, crash, 1, lines, nil)
		_, err := c.Stdin.Write([]byte(key + "\n"))
		require.NoError(t, err)
		var got []childLine
		if crash == "" {
			got = append(got, <-lines)
			require.NoError(t, c.Stdin.Close())
		}
		c.Wait(t, 20*time.Second)
		for len(lines) > 0 {
			got = append(got, <-lines)
		}
		return c, got
	}

	t.Run("before-commit", func(t *testing.T) {
		t.Parallel()
		pool, schema := setupPayments(t, 2)
		c, lines := feed(t, schema, "before-commit:nth=1")
		require.True(t, c.Killed(), "state %v; stderr:\n%s", c.State(), c.Output())
		require.Contains(t, c.Output(), "crash point before-commit fired")
		require.Empty(t, lines, "no answer before the crash")
		require.Zero(t, pgtest.Count(t, pool, `SELECT count(*) FROM inbox`), "nothing committed")
		require.Zero(t, pgtest.Count(t, pool, `SELECT count(*) FROM ledger`))
		require.Zero(t, pgtest.Count(t, pool, `SELECT count(*) FROM effects`))

		c, lines = feed(t, schema, "")
		require.Equal(t, 0, c.ExitCode())
		require.Equal(t, []string{"ack"}, answers(lines))
		require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM ledger WHERE key = $1`, key))
	})

	t.Run("after-commit-before-ack", func(t *testing.T) {
		t.Parallel()
		pool, schema := setupPayments(t, 2)
		c, lines := feed(t, schema, "after-commit-before-ack:nth=1")
		require.True(t, c.Killed(), "state %v; stderr:\n%s", c.State(), c.Output())
		require.Empty(t, lines, "killed before the ack")
		require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE state = 'completed'`), "committed")
		require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM ledger`))
		require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE state = 'pending'`))

		// The broker redelivers the un-acked message to a new process: a duplicate.
		c, lines = feed(t, schema, "")
		require.Equal(t, 0, c.ExitCode())
		require.Equal(t, []string{"ack"}, answers(lines))
		require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM ledger`), "still once")
	})

	t.Run("mid-send", func(t *testing.T) {
		t.Parallel()
		pool, schema := setupPayments(t, 2)
		st := newStack(idemTransactional, pool, schema, nil, nil)
		defer st.close()
		_, err := st.handler(message.NewMessage(key, paymentPayload(key)))
		require.NoError(t, err)

		c := startChild(t, 1, "sender", schema, idemTransactional, "mid-send:nth=1", 1, nil, nil)
		c.Wait(t, 20*time.Second)
		require.True(t, c.Killed(), "state %v; stderr:\n%s", c.State(), c.Output())
		require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM emails`), "sent")
		require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE state = 'pending'`), "not marked")

		// After the lease, a new sender sends it again, under the same effect key.
		pgtest.WaitFor(t, 30*time.Second, "the lease ran out", func() bool {
			return pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE state = 'pending' AND next_attempt_at <= now()`) == 1
		})
		c = startChild(t, 2, "sender", schema, idemTransactional, "", 1, nil, nil)
		c.Wait(t, 20*time.Second)
		require.Equal(t, 0, c.ExitCode(), c.Output())
		require.Equal(t, 2, pgtest.Count(t, pool, `SELECT count(*) FROM emails WHERE effect_key = $1`, "receipt:"+key))

		a, err := chaos.NewAuditor(chaos.AuditorConfig{Pool: pool, Schema: schema})
		require.NoError(t, err)
		q := withSends(auditQuery(idemTransactional, []string{key}, -1, -1), pool)
		rep, err := a.Report(context.Background(), q)
		require.NoError(t, err)
		require.True(t, rep.OK(), "\n%s", rep)
		require.Equal(t, 1, rep.EffectsDone)
		require.Equal(t, 1, rep.SendsRepeated, "a send cut by a kill may repeat, with the same key")
	})
}

func answers(lines []childLine) []string {
	var out []string
	for _, l := range lines {
		out = append(out, l.answer)
	}
	return out
}
