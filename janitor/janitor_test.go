package janitor_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"strings"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/janitor"
)

// seedJanitor writes n rows of every kind the janitor must tell apart: expired and
// fresh settled inbox rows, expired processing rows, and old and fresh effects in
// each state. Keys are prefixed by what must happen to them.
func seedJanitor(t testing.TB, pool *pgxpool.Pool, n int) {
	t.Helper()
	ctx := context.Background()
	for _, q := range []string{
		// deleted: settled and expired
		`INSERT INTO inbox (consumer, key, fingerprint, state, completed_at, expires_at)
			SELECT 'c', 'gone-completed-' || i, '\x00', 'completed', now() - interval '8 days', now() - interval '1 day' - i * interval '1 s'
			FROM generate_series(1, $1) i`,
		`INSERT INTO inbox (consumer, key, fingerprint, state, completed_at, expires_at, error_code, error)
			SELECT 'c', 'gone-failed-' || i, '\x00', 'failed', now() - interval '8 days', now() - interval '1 hour', 'permanent', 'boom'
			FROM generate_series(1, $1) i`,
		// kept: not expired yet
		`INSERT INTO inbox (consumer, key, fingerprint, state, completed_at, expires_at)
			SELECT 'c', 'keep-fresh-' || i, '\x00', 'completed', now(), now() + interval '7 days'
			FROM generate_series(1, $1) i`,
		// kept: processing, even long past its expiry
		`INSERT INTO inbox (consumer, key, fingerprint, state, lease_until, fence, expires_at)
			SELECT 'c', 'keep-processing-' || i, '\x00', 'processing', now() - interval '9 days', 1, now() - interval '8 days'
			FROM generate_series(1, $1) i`,
		// effects: only old done ones go
		`INSERT INTO effects (kind, key, fingerprint, state, done_at, created_at)
			SELECT 'email', 'gone-done-' || i, '\x00', 'done', now() - interval '8 days', now() - interval '9 days'
			FROM generate_series(1, $1) i`,
		`INSERT INTO effects (kind, key, fingerprint, state, done_at)
			SELECT 'email', 'keep-done-fresh-' || i, '\x00', 'done', now() - interval '1 day'
			FROM generate_series(1, $1) i`,
		`INSERT INTO effects (kind, key, fingerprint, state, created_at, next_attempt_at)
			SELECT 'email', 'keep-pending-' || i, '\x00', 'pending', now() - interval '30 days', now() - interval '30 days'
			FROM generate_series(1, $1) i`,
		// dead effects are never deleted, even with an old done_at
		`INSERT INTO effects (kind, key, fingerprint, state, done_at, created_at)
			SELECT 'email', 'keep-dead-' || i, '\x00', 'dead', now() - interval '30 days', now() - interval '30 days'
			FROM generate_series(1, $1) i`,
	} {
		_, err := pool.Exec(ctx, q, n)
		require.NoError(t, err)
	}
}

func newJanitor(t *testing.T, pool *pgxpool.Pool, schema string, mutate ...func(*janitor.Config)) *janitor.Janitor {
	t.Helper()
	cfg := janitor.Config{Pool: pool, Schema: schema, Pause: -1}
	for _, m := range mutate {
		m(&cfg)
	}
	j, err := janitor.New(cfg)
	require.NoError(t, err)
	return j
}

func TestJanitorDeletesOnlyWhatRetentionLetsGo(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.Setup(t)
	seedJanitor(t, pool, 25)
	var batches []janitor.Stats
	reg := prometheus.NewRegistry()
	j := newJanitor(t, pool, schema, func(c *janitor.Config) {
		c.BatchSize = 10
		c.Registerer = reg
		c.OnBatch = func(s janitor.Stats) { batches = append(batches, s) }
	})

	st, err := j.RunOnce(context.Background())
	require.NoError(t, err)
	require.EqualValues(t, 50, st.InboxDeleted)
	require.EqualValues(t, 25, st.EffectsDeleted)
	require.EqualValues(t, 75, st.Deleted())

	require.Zero(t, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE key LIKE 'gone-%'`))
	require.Zero(t, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE key LIKE 'gone-%'`))
	require.Equal(t, 50, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE key LIKE 'keep-%'`))
	require.Equal(t, 25, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE state = 'processing'`))
	require.Equal(t, 75, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE key LIKE 'keep-%'`))
	require.Equal(t, 25, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE state = 'pending'`))
	require.Equal(t, 25, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE state = 'dead'`))

	// Batch size: no step between two progress reports deletes more than 10 rows
	// of one table.
	require.NotEmpty(t, batches)
	var prev janitor.Stats
	for _, b := range batches {
		require.LessOrEqual(t, b.InboxDeleted-prev.InboxDeleted, int64(10))
		require.LessOrEqual(t, b.EffectsDeleted-prev.EffectsDeleted, int64(10))
		prev = b
	}
	// 50 inbox rows in batches of 10, the last one short (empty), and 25 effects
	// in 10+10+5: 8 DELETEs removed rows.
	require.Equal(t, 8, st.Batches)

	require.Equal(t, 50.0, counterOf(t, reg, "idem_janitor_deleted_total", "inbox"))
	require.Equal(t, 25.0, counterOf(t, reg, "idem_janitor_deleted_total", "effects"))

	// A second pass finds nothing.
	st, err = j.RunOnce(context.Background())
	require.NoError(t, err)
	require.Zero(t, st.Deleted())
}

// counterOf reads the counter name{table=table} from reg.
func counterOf(t *testing.T, reg *prometheus.Registry, name, table string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "table" && l.GetValue() == table {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	t.Fatalf("metric %s{table=%q} not found", name, table)
	return 0
}

func TestDeleteExpiredRespectsLimit(t *testing.T) {
	pool, schema := pgtest.Setup(t)
	store, err := inboxdb.NewStore(schema)
	require.NoError(t, err)
	seedJanitor(t, pool, 30)
	n, err := store.DeleteExpired(context.Background(), pool, 7)
	require.NoError(t, err)
	require.EqualValues(t, 7, n)
	// The oldest expiry goes first.
	require.Equal(t, 0, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE key = 'gone-completed-30'`))
	require.Equal(t, 53, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE key LIKE 'gone-%'`))
}

func TestJanitorOneInstanceAtATime(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.Setup(t)
	seedJanitor(t, pool, 5)
	j := newJanitor(t, pool, schema)
	ctx := context.Background()

	// Another process holds the schema's janitor lock.
	other, err := pgx.Connect(ctx, pgtest.URL())
	require.NoError(t, err)
	defer func() { require.NoError(t, other.Close(ctx)) }()
	_, err = other.Exec(ctx, `SELECT pg_advisory_lock(hashtextextended('idem.janitor:' || $1, 0))`, schema)
	require.NoError(t, err)

	_, err = j.RunOnce(ctx)
	require.ErrorIs(t, err, janitor.ErrBusy)
	require.Equal(t, "janitor_busy", inbox.Code(err))
	require.Equal(t, 10, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE key LIKE 'gone-%'`))

	_, err = other.Exec(ctx, `SELECT pg_advisory_unlock(hashtextextended('idem.janitor:' || $1, 0))`, schema)
	require.NoError(t, err)
	st, err := j.RunOnce(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 15, st.Deleted())

	// The pass released its lock: another session can take it.
	var got bool
	require.NoError(t, other.QueryRow(ctx, `SELECT pg_try_advisory_lock(hashtextextended('idem.janitor:' || $1, 0))`, schema).Scan(&got))
	require.True(t, got)
}

func TestJanitorConcurrentPassesDeleteEachRowOnce(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.Setup(t)
	seedJanitor(t, pool, 200)
	var total atomic.Int64
	var wg sync.WaitGroup
	for range 3 {
		wg.Go(func() {
			j := newJanitor(t, pool, schema, func(c *janitor.Config) { c.BatchSize = 50 })
			st, err := j.RunOnce(context.Background())
			if errors.Is(err, janitor.ErrBusy) {
				return
			}
			if err != nil {
				t.Error(err)
				return
			}
			total.Add(st.Deleted())
		})
	}
	wg.Wait()
	// Passes that did not overlap may all have run; together they deleted each
	// expired row once.
	require.EqualValues(t, 600, total.Load())
}

func TestJanitorRunUntilCancelled(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.Setup(t)
	seedJanitor(t, pool, 5)
	reg := prometheus.NewRegistry()
	j := newJanitor(t, pool, schema, func(c *janitor.Config) {
		c.Interval = 20 * time.Millisecond
		c.Registerer = reg
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- j.Run(ctx) }()
	pgtest.WaitFor(t, 30*time.Second, "the expired rows deleted", func() bool {
		return pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE key LIKE 'gone-%'`) == 0
	})
	// Rows that expire later are picked up by a later pass.
	_, err := pool.Exec(context.Background(), `INSERT INTO inbox (consumer, key, fingerprint, state, expires_at)
		VALUES ('c', 'late', '\x00', 'completed', now() - interval '1 s')`)
	require.NoError(t, err)
	pgtest.WaitFor(t, 30*time.Second, "the late row deleted by a later pass", func() bool {
		return pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE key = 'late'`) == 0
	})
	// The row is gone once its DELETE commits, a moment before the pass reads the
	// answer and counts it: a cancel in between would cut the pass off uncounted.
	pgtest.WaitFor(t, 30*time.Second, "the late row counted", func() bool {
		return counterOf(t, reg, "idem_janitor_deleted_total", "inbox") == 11
	})
	cancel()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(5 * time.Second):
		t.Fatal("Run did not return after cancel")
	}
	require.Equal(t, 11.0, counterOf(t, reg, "idem_janitor_deleted_total", "inbox"))
	require.Equal(t, 5.0, counterOf(t, reg, "idem_janitor_deleted_total", "effects"))
}

func TestJanitorMissingSchemaAndBadConfig(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.Setup(t, pgtest.Options{NoMigrate: true})
	j := newJanitor(t, pool, schema)
	_, err := j.RunOnce(context.Background())
	require.ErrorIs(t, err, inbox.ErrSchemaMissing)

	for _, cfg := range []janitor.Config{
		{},
		{Pool: pool, Schema: "Bad-Schema"},
		{Pool: pool, BatchSize: -1},
		{Pool: pool, EffectsRetention: time.Second},
	} {
		_, err := janitor.New(cfg)
		require.True(t, strings.HasPrefix(err.Error(), "invalid config: "), "%+v: %v", cfg, err)
	}
	_, err = janitor.New(janitor.Config{})
	require.ErrorIs(t, err, janitor.ErrInvalidConfig)
	require.Equal(t, "invalid_config", inbox.Code(err))
}

// TestConfigConvention: Validate passes on a config that sets only what is
// required (it checks the defaulted config), and WithDefaults fills every default.
func TestConfigConvention(t *testing.T) {
	t.Parallel()
	fresh := janitor.Config{Pool: &pgxpool.Pool{}}
	require.NoError(t, fresh.Validate())
	d := fresh.WithDefaults()
	require.Equal(t, janitor.DefaultSchema, d.Schema)
	require.Equal(t, janitor.DefaultBatchSize, d.BatchSize)
	require.Equal(t, janitor.DefaultPause, d.Pause)
	require.Equal(t, janitor.DefaultInterval, d.Interval)
	require.Equal(t, janitor.DefaultEffectsRetention, d.EffectsRetention)
	require.NotNil(t, d.Logger)
	require.ErrorIs(t, janitor.Config{}.Validate(), janitor.ErrInvalidConfig)
}

// BenchmarkJanitor deletes 1M expired inbox rows while a claimer keeps claiming new
// keys, and reports the deletion rate and the claimer's latency with the janitor
// running (p99, max) and, for comparison, for as long without it (base-max): a
// busy host makes both worse, the janitor only the first.
//
//	go test ./janitor -run '^$' -bench Janitor -benchtime 1x
//
// IDEM_BENCH_BATCH and IDEM_BENCH_PAUSE override the batch size and the pause.
func BenchmarkJanitor(b *testing.B) {
	const rows = 1_000_000
	pool, schema := pgtest.Setup(b, pgtest.Options{MaxConns: 4})
	store, err := inboxdb.NewStore(schema)
	require.NoError(b, err)
	ctx := context.Background()
	cfg := janitor.Config{Pool: pool, Schema: schema}
	if v := os.Getenv("IDEM_BENCH_BATCH"); v != "" {
		cfg.BatchSize, _ = strconv.Atoi(v)
	}
	if v := os.Getenv("IDEM_BENCH_PAUSE"); v != "" {
		cfg.Pause, _ = time.ParseDuration(v)
	}
	j, err := janitor.New(cfg)
	require.NoError(b, err)

	// claimer claims new keys, one transaction each, until stop closes, and
	// returns each claim's latency.
	var seq atomic.Int64
	claimer := func(stop <-chan struct{}) <-chan []time.Duration {
		out := make(chan []time.Duration, 1)
		go func() {
			var lat []time.Duration
			defer func() { out <- lat }()
			for {
				select {
				case <-stop:
					return
				default:
				}
				t0 := time.Now()
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					_, err := store.ClaimTx(ctx, tx, inboxdb.Claim{
						ID:          inboxdb.ID{Consumer: "bench", Key: fmt.Sprintf("new-%d", seq.Add(1))},
						Fingerprint: []byte{1},
					})
					return err
				})
				if err != nil {
					b.Error(err)
					return
				}
				lat = append(lat, time.Since(t0))
			}
		}()
		return out
	}
	maxOf := func(lat []time.Duration) time.Duration {
		if len(lat) == 0 {
			return 0
		}
		return slices.Max(lat)
	}

	var withJanitor, baseline []time.Duration
	for range b.N {
		b.StopTimer()
		_, err := pool.Exec(ctx, `INSERT INTO inbox (consumer, key, fingerprint, state, completed_at, expires_at)
			SELECT 'bench', 'k' || i, '\x0102030405060708', 'completed', now() - interval '8 days',
				now() - interval '1 day' + (i % 3600) * interval '1 s'
			FROM generate_series(1, $1) i`, rows)
		require.NoError(b, err)
		_, err = pool.Exec(ctx, `VACUUM ANALYZE inbox`)
		require.NoError(b, err)

		stop := make(chan struct{})
		lat := claimer(stop)
		b.StartTimer()
		st, err := j.RunOnce(ctx)
		b.StopTimer()
		close(stop)
		withJanitor = append(withJanitor, <-lat...)
		require.NoError(b, err)
		require.EqualValues(b, rows, st.InboxDeleted)
		b.ReportMetric(float64(st.InboxDeleted)/st.Elapsed.Seconds(), "rows/s")

		stop = make(chan struct{})
		lat = claimer(stop)
		time.Sleep(st.Elapsed)
		close(stop)
		baseline = append(baseline, <-lat...)
		b.StartTimer()
	}
	b.StopTimer()
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	slices.Sort(withJanitor)
	if n := len(withJanitor); n > 0 {
		b.ReportMetric(ms(withJanitor[n*99/100]), "p99-claim-ms")
	}
	b.ReportMetric(ms(maxOf(withJanitor)), "max-claim-ms")
	b.ReportMetric(ms(maxOf(baseline)), "base-max-claim-ms")
	b.ReportMetric(float64(len(withJanitor)), "claims")
}

// TestJanitorMetricsExistFromStart: right after NewJanitor, before any pass, a scrape
// has every janitor series of the schema at 0: deletions per table, passes per
// result, and the last success (0: never, so an alert on a janitor that never
// succeeds fires). (Before, each series appeared at its first increment.)
func TestJanitorMetricsExistFromStart(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 2})
	reg := prometheus.NewRegistry()
	_, err := janitor.New(janitor.Config{Pool: pool, Schema: schema, Registerer: reg})
	require.NoError(t, err)
	mfs, err := reg.Gather()
	require.NoError(t, err)
	have := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.Metric {
			key := mf.GetName()
			for _, l := range m.Label {
				key += "," + l.GetName() + "=" + l.GetValue()
			}
			if m.Counter != nil {
				have[key] = m.GetCounter().GetValue()
			} else {
				have[key] = m.GetGauge().GetValue()
			}
		}
	}
	for _, want := range []string{
		"idem_janitor_deleted_total,schema=" + schema + ",table=inbox",
		"idem_janitor_deleted_total,schema=" + schema + ",table=effects",
		"idem_janitor_passes_total,result=ok,schema=" + schema,
		"idem_janitor_passes_total,result=busy,schema=" + schema,
		"idem_janitor_passes_total,result=error,schema=" + schema,
		"idem_janitor_last_success_timestamp_seconds,schema=" + schema,
	} {
		v, ok := have[want]
		require.True(t, ok, "%s missing before any pass; have %v", want, have)
		require.Zero(t, v, want)
	}
}

// TestJanitorDeletesDiscardedEffects: an effect an operator discarded goes after
// the retention of done effects, counted from when it was discarded; a recent one
// stays, and so does a dead one however old.
func TestJanitorDeletesDiscardedEffects(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.Setup(t)
	_, err := pool.Exec(context.Background(), `INSERT INTO effects (kind, key, fingerprint, state, done_at, created_at) VALUES
		('email', 'gone-1', '\x00', 'discarded', now() - interval '8 days', now() - interval '30 days'),
		('email', 'gone-2', '\x00', 'discarded', now() - interval '9 days', now() - interval '30 days'),
		('email', 'keep-1', '\x00', 'discarded', now() - interval '1 day', now() - interval '30 days'),
		('email', 'keep-2', '\x00', 'dead', now() - interval '30 days', now() - interval '30 days')`)
	require.NoError(t, err)
	st, err := newJanitor(t, pool, schema, func(c *janitor.Config) { c.BatchSize = 1 }).RunOnce(context.Background())
	require.NoError(t, err)
	require.EqualValues(t, 2, st.EffectsDeleted)
	require.Equal(t, 2, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE key LIKE 'keep-%'`))
	require.Zero(t, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE key LIKE 'gone-%'`))
}
