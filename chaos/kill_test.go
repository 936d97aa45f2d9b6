package chaos_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/chaos"
	"github.com/idemkit/idem/internal/pgtest"
)

// killRun is what one flavour's kill run did.
type killRun struct {
	report           chaos.Report
	deliveries       int
	sigkills         int
	restarts, pgCuts int
}

// runKillChaos plays broker to three consumer processes: it feeds n payment keys
// (30% of them twice, as a retrying producer would), redelivers 10% of acked keys
// (as a broker that lost its ack), and redelivers every key a process had in
// flight when it died. Every process is armed to kill itself after a few commits
// (after-commit-before-ack) and sometimes before a commit; on top of that the parent
// SIGKILLs a random busy process (one that has answered since it started) every
// 100 ms and cuts the Postgres backends twice. Dead processes are replaced. The
// run ends when every key has been acked.
func runKillChaos(t *testing.T, f flavour, n int, seed int64) killRun {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute) // generous: a loaded 2-core CI machine
	defer cancel()
	pool, schema := setupPayments(t, 3)
	rng := rand.New(rand.NewPCG(uint64(seed), 7))

	const slots, capacity = 3, 6
	keys := paymentKeys(n)
	var queue []string
	for _, k := range keys {
		queue = append(queue, k)
		if rng.Float64() < 0.3 {
			queue = append(queue, k)
		}
	}
	rng.Shuffle(len(queue), func(i, j int) { queue[i], queue[j] = queue[j], queue[i] })

	lines := make(chan childLine, 256)
	exits := make(chan *child, 16)
	inflight := map[*child]map[string]int{}
	// answered is the children that have answered at least once: the parent kills
	// only those, so every process makes progress before it can die. (A process
	// killed before its first answer, on a loaded machine where starting one takes
	// longer than the killer's tick, would make none, and the run would never end.)
	answered := map[*child]bool{}
	live := make([]*child, slots)
	var run killRun
	nextID := 0
	start := func(slot int) {
		nextID++
		crash := fmt.Sprintf("after-commit-before-ack:nth=%d,before-commit:0.02", 4+rng.IntN(20))
		c := startChild(t, nextID, "consumer", schema, f, crash, seed+int64(nextID), lines, exits)
		live[slot] = c
		inflight[c] = map[string]int{}
	}
	for i := range slots {
		start(i)
	}
	acked := map[string]bool{}
	redelivered := map[string]bool{}
	killer := time.NewTicker(100 * time.Millisecond)
	defer killer.Stop()
	cutAt := []int{n / 3, 2 * n / 3}

	dispatch := func() {
		for _, c := range live {
			if c == nil {
				continue
			}
			for len(queue) > 0 && sum(inflight[c]) < capacity {
				k := queue[0]
				queue = queue[1:]
				inflight[c][k]++
				run.deliveries++
				// A write to a process that just died fails; its exit redelivers.
				_, _ = c.Stdin.Write([]byte(k + "\n"))
			}
		}
	}
	for len(acked) < n || len(queue) > 0 || !allEmpty(inflight) {
		dispatch()
		select {
		case <-ctx.Done():
			t.Fatalf("kill run did not finish: %d/%d acked, %d queued", len(acked), n, len(queue))
		case l := <-lines:
			if inflight[l.c][l.key] == 0 {
				continue // answered after the parent gave it up; cannot happen, but be safe
			}
			inflight[l.c][l.key]--
			answered[l.c] = true
			if l.answer != "ack" {
				queue = append(queue, l.key)
				continue
			}
			acked[l.key] = true
			if !redelivered[l.key] && rng.Float64() < 0.1 {
				redelivered[l.key] = true
				queue = append(queue, l.key)
			}
			if len(cutAt) > 0 && len(acked) >= cutAt[0] {
				cutAt = cutAt[1:]
				pgtest.TerminateBackends(t, schema)
				run.pgCuts++
			}
		case c := <-exits:
			if c.Killed() {
				run.sigkills++
			} else {
				t.Fatalf("child %d exited on its own (%v):\n%s", c.id, c.State(), c.Output())
			}
			for k, m := range inflight[c] {
				for range m {
					queue = append(queue, k) // un-acked: the broker redelivers
				}
			}
			delete(inflight, c)
			delete(answered, c)
			for i := range live {
				if live[i] == c {
					live[i] = nil
					run.restarts++
					start(i)
				}
			}
		case <-killer.C:
			var busy []*child
			for _, c := range live {
				if c != nil && answered[c] && sum(inflight[c]) > 0 {
					busy = append(busy, c)
				}
			}
			if len(busy) > 0 {
				_ = busy[rng.IntN(len(busy))].Kill() // SIGKILL
			}
		}
	}
	for _, c := range live {
		_ = c.Stdin.Close()
	}
	for _, c := range live {
		c.Wait(t, 20*time.Second)
		if !c.Killed() {
			require.Equal(t, 0, c.ExitCode(), c.Output())
		}
	}

	// The run's cuts hit this pool's idle connections too (they carry the same
	// application_name); pgxpool finds a dead one only when it uses it, so start the
	// checks on fresh ones.
	pool.Reset()
	if f != peerDeduplicator {
		_, err := sendEmails(ctx, pool, time.Second)
		require.NoError(t, err)
	}
	a, err := chaos.NewAuditor(chaos.AuditorConfig{Pool: pool, Schema: schema, SettleQuiet: 200 * time.Millisecond})
	require.NoError(t, err)
	q := withSends(auditQuery(f, keys, int64(run.deliveries), -1), pool)
	run.report, err = a.Settled(ctx, q)
	require.NoError(t, err)
	return run
}

func sum(m map[string]int) int {
	s := 0
	for _, v := range m {
		s += v
	}
	return s
}

func allEmpty(m map[*child]map[string]int) bool {
	for _, in := range m {
		if sum(in) > 0 {
			return false
		}
	}
	return true
}

// TestSIGKILLConsumerProcesses runs the kill run through idem in both commit
// modes and through Watermill's Deduplicator, and prints the three reports. idem
// must commit every payment once and lose nothing.
func TestSIGKILLConsumerProcesses(t *testing.T) {
	t.Parallel()
	const n, seed = 200, 6
	flavours := []flavour{idemTransactional, idemGroupCommit, peerDeduplicator}
	runs := make([]killRun, len(flavours))
	var mu sync.Mutex
	t.Run("runs", func(t *testing.T) {
		for i, f := range flavours {
			t.Run(string(f), func(t *testing.T) {
				t.Parallel()
				r := runKillChaos(t, f, n, seed)
				mu.Lock()
				runs[i] = r
				mu.Unlock()
				t.Logf("%s: %d deliveries, %d SIGKILLs, %d restarts, %d Postgres cuts", f, r.deliveries, r.sigkills, r.restarts, r.pgCuts)
				require.GreaterOrEqual(t, r.sigkills, 5, "the run must actually kill processes")
				if f == peerDeduplicator {
					return
				}
				rep := r.report
				require.NoError(t, rep.Err(), "\n%s", rep)
				require.Equal(t, n, rep.CommittedOnce)
				require.Equal(t, n, rep.EffectsDone)
				require.Equal(t, n, rep.SendsOnce+rep.SendsRepeated)
			})
		}
	})
	if t.Failed() {
		return
	}
	var reps []chaos.Report
	for i, f := range flavours {
		r := runs[i].report
		r.Consumer = string(f) // the column's title
		reps = append(reps, r)
	}
	t.Logf("SIGKILL run, N=%d, 3 consumer processes, seed %d:\n%s", n, seed, reps[0].Beside(reps[1:]...))
	require.Positive(t, runs[2].report.CommittedTwice, "the peer never committed twice; the kills are not biting:\n%s", runs[2].report)
}
