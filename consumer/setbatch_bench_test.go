package consumer

import (
	"context"
	"crypto/sha256"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/cpustat"
	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/pgtest"
)

// BenchmarkSetBatch is the database work of one set-based batch as idem sends it,
// without Watermill or handlers: the prelude and the claim of 256 keys (a tenth
// of them redeliveries of keys committed by the batch before), one effect per
// claimed key written with EnqueueItems, and the COMMIT, on one connection. It
// reports the CPU time per message of this process ("go-µs/msg") and of the
// connection's Postgres backend ("pg-µs/msg", from /proc/<pid>/schedstat), that
// backend's share of each step (pg-claim, pg-effects, pg-commit: the backend is
// idle between them, so each is exact), and allocations per message, so that
// statement shapes and encodings can be compared with benchstat.
//
//	go test -run '^$' -bench SetBatch -benchtime 200x -count 6 ./consumer
func BenchmarkSetBatch(b *testing.B) {
	pool, schema := pgtest.Setup(b, pgtest.Options{MaxConns: 1})
	ctx := context.Background()
	front, err := New(Config{Name: "bench", Pool: pool, Schema: schema})
	require.NoError(b, err)
	c := front.parts.Part(0)
	const n = 256
	payload := make([]byte, 128)
	var prev []batchClaim
	batch := func() []batchClaim {
		claims := make([]batchClaim, 0, n)
		for i := range n {
			if i%10 == 9 && len(prev) > i {
				claims = append(claims, prev[i]) // a redelivery
				continue
			}
			fp := sha256.Sum256(payload)
			claims = append(claims, batchClaim{Claim: inboxdb.Claim{ID: inboxdb.ID{Consumer: "bench", Key: NewUUID()},
				Fingerprint: fp[:], Retention: c.cfg.Retention}})
		}
		prev = claims
		return claims
	}
	var pid int
	require.NoError(b, pool.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
	stat := "/proc/" + strconv.Itoa(pid) + "/schedstat"
	var steps [3]time.Duration // claim, effects, commit
	step := func(k int, t0 time.Duration) time.Duration {
		t, _ := cpustat.Schedstat(stat)
		steps[k] += t - t0
		return t
	}
	run := func(claims []batchClaim) {
		tx, err := c.beginGroup(ctx)
		require.NoError(b, err)
		defer func() { _ = tx.Rollback(ctx) }()
		t0, _ := cpustat.Schedstat(stat)
		res, err := c.batchStore.ClaimBatchTx(ctx, tx, c.setPrelude, claims, false)
		require.NoError(b, err)
		t0 = step(0, t0)
		items := make([]effectsdb.Item, 0, len(claims))
		for i, r := range res {
			if r.Claimed {
				items = append(items, effectsdb.Item{
					Scope:  effectsdb.Scope{Schema: schema, Source: effectsdb.Source{Consumer: "bench", Key: claims[i].Key}},
					Effect: effectsdb.Effect{Kind: "bench", Key: "fx:" + claims[i].Key, Payload: payload}})
			}
		}
		_, err = effectsdb.EnqueueItems(ctx, tx, items)
		require.NoError(b, err)
		t0 = step(1, t0)
		require.NoError(b, c.commit(ctx, tx))
		step(2, t0)
	}
	run(batch()) // the connection, its prepared statements and the plans
	claims := make([][]batchClaim, b.N)
	for i := range claims {
		claims[i] = batch()
	}
	app := "idem-test:" + schema
	before := cpustat.Take(ctx, pool, app)
	steps = [3]time.Duration{}
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		run(claims[i])
	}
	b.StopTimer()
	d := cpustat.Take(ctx, pool, app).Since(before)
	msgs := b.N * n
	b.ReportMetric(cpustat.PerOp(d.Self, msgs), "go-µs/msg")
	if d.BackendsSeen {
		b.ReportMetric(cpustat.PerOp(d.Backends, msgs), "pg-µs/msg")
		b.ReportMetric(cpustat.PerOp(steps[0], msgs), "pg-claim-µs/msg")
		b.ReportMetric(cpustat.PerOp(steps[1], msgs), "pg-effects-µs/msg")
		b.ReportMetric(cpustat.PerOp(steps[2], msgs), "pg-commit-µs/msg")
	}
	b.ReportMetric(float64(d.Mallocs)/float64(msgs), "allocs/msg")
	var rows int
	require.NoError(b, pool.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{schema, "effects"}.Sanitize()).Scan(&rows))
	require.Positive(b, rows)
}
