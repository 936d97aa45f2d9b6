package janitor

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem/internal/citusmode"
	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/fanout"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/promreg"
	"github.com/idemkit/idem/shard"
)

// Defaults of Config.
const (
	// DefaultSchema is the schema of the idem tables unless Config.Schema says
	// otherwise.
	DefaultSchema = pgschema.Default
	// DefaultBatchSize is how many rows one DELETE removes. Small batches keep each
	// transaction short, so a concurrent claim never waits long on it.
	DefaultBatchSize = 2000
	// DefaultPause is the pause between two batches, which leaves room for the
	// other traffic and for autovacuum.
	DefaultPause = 5 * time.Millisecond
	// DefaultInterval is the time between two passes of Run.
	DefaultInterval = time.Minute
	// DefaultEffectsRetention is how long done effects are kept after done_at.
	DefaultEffectsRetention = 7 * 24 * time.Hour
)

// Config configures a Janitor.
type Config struct {
	// Pool runs the deletes. Required. The janitor holds one of its connections
	// for a whole pass, because the advisory lock belongs to that session.
	Pool *pgxpool.Pool
	// Schema holds the idem tables (default "idem").
	Schema string
	// Shards, in place of Pool and Schema, cleans several databases (see package
	// shard); Pool and Schema must then be unset. Each shard has its own advisory
	// lock; RunOnce passes over them one after another and adds up the Stats, and
	// Run runs a loop a shard.
	Shards *shard.Map
	// BatchSize is the most rows one DELETE removes (default 2000).
	BatchSize int
	// Pause is the wait between batches (default 5 ms). A negative Pause means none.
	Pause time.Duration
	// EffectsRetention is how long done and discarded effects stay after done_at
	// (default 7 days). Pending and dead effects are never deleted.
	EffectsRetention time.Duration
	// Interval is the time between the passes of Run (default 1 minute).
	Interval time.Duration
	// OnBatch, if set, is called after every batch with the pass's totals so far,
	// for progress reports.
	OnBatch func(Stats)
	// Logger gets structured logs (nil: quiet).
	Logger *slog.Logger
	// Registerer gets the janitor's Prometheus collectors (nil: not registered).
	Registerer prometheus.Registerer
}

// WithDefaults returns c with every unset field at its default.
func (c Config) WithDefaults() Config {
	c.Schema = fanout.Schema(c.Shards, c.Schema, DefaultSchema)
	c.BatchSize = cmp.Or(c.BatchSize, DefaultBatchSize)
	c.Pause = cmp.Or(c.Pause, DefaultPause)
	c.EffectsRetention = cmp.Or(c.EffectsRetention, DefaultEffectsRetention)
	c.Interval = cmp.Or(c.Interval, DefaultInterval)
	c.Logger = cmp.Or(c.Logger, slog.New(slog.DiscardHandler))
	return c
}

// Validate reports what New would refuse in c: no Pool, a bad schema, a batch size,
// retention or interval out of range. It checks c.WithDefaults(), so a config with a
// Pool passes.
func (c Config) Validate() error {
	c = c.WithDefaults()
	if err := fanout.ValidateDB(c.Shards, c.Pool, c.Schema); err != nil {
		return err
	}
	if c.BatchSize < 1 || c.BatchSize > 100_000 {
		return errcode.InvalidConfig("BatchSize %d is outside 1..100000", c.BatchSize)
	}
	if c.EffectsRetention < time.Minute {
		return errcode.InvalidConfig("EffectsRetention %s is under a minute", c.EffectsRetention)
	}
	if c.Interval < time.Millisecond {
		return errcode.InvalidConfig("Interval %s is under a millisecond", c.Interval)
	}
	return nil
}

// Stats is what one janitor pass did.
type Stats struct {
	// InboxDeleted counts expired completed and failed inbox rows deleted.
	InboxDeleted int64
	// EffectsDeleted counts done and discarded effects deleted after their
	// retention.
	EffectsDeleted int64
	// Batches counts the DELETE statements that removed at least one row.
	Batches int
	// Elapsed is the pass's duration.
	Elapsed time.Duration
}

// Deleted is the total number of rows deleted.
func (s Stats) Deleted() int64 { return s.InboxDeleted + s.EffectsDeleted }

// Janitor deletes what the retention lets go: inbox rows in state completed or
// failed whose expires_at has passed, and effects in state done or discarded whose
// done_at is older than EffectsRetention. It never deletes processing inbox rows, nor pending
// or dead effects: those are work not yet settled.
//
// It deletes in batches of BatchSize, each its own short transaction, with Pause
// between them. The rows are picked in expiry order through the partial indexes
// that the migrations create for this, and locked with SKIP LOCKED, so the janitor
// never waits on a row that someone else holds. On Citus (a schema migrated with
// migrate.Config.Citus, asked on the first pass) the rows are picked the same way
// and deleted by primary key, without the row locks Citus refuses across shards;
// a row someone holds is then waited for.
//
// A Postgres advisory lock (per schema) keeps it to one running pass at a time
// across all processes, so every consumer and dispatcher process may run one.
type Janitor struct {
	parts *fanout.Set[*part]
}

// part is the Janitor of one database: one of a shard map's, or the only one.
type part struct {
	cfg             Config
	q               queries
	deleted, passes *prometheus.CounterVec
	lastOK          *prometheus.GaugeVec
	// citus: whether the schema is distributed by Citus, asked on the first pass.
	citus citusmode.Detector
}

var (
	// ErrInvalidConfig is wrapped by the error New returns for a config it refuses
	// (code "invalid_config"), unless a more specific sentinel says what is wrong
	// (inbox.ErrInvalidSchema). Every idem package has the same value.
	ErrInvalidConfig = errcode.ErrInvalidConfig

	// ErrBusy is returned when another janitor holds the schema's advisory lock and
	// is running a pass. It is not a failure: that janitor does the work.
	ErrBusy = errcode.Transient("janitor_busy", "another janitor is running a pass on this schema (it holds the advisory lock)")
)

// New returns a Janitor, or an error that wraps "invalid config".
func New(cfg Config) (*Janitor, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	parts, err := fanout.Build(cfg.Shards, cfg, cfg.forShard, newPart)
	if err != nil {
		return nil, err
	}
	return &Janitor{parts: parts}, nil
}

// forShard returns c for sh's part: sh's database, and c's logger and registerer
// labelled with sh's name.
func (c Config) forShard(sh shard.Shard) Config {
	c.Shards, c.Pool, c.Schema = nil, sh.Pool, sh.SchemaName()
	c.Logger, c.Registerer = fanout.Label(sh, c.Logger, c.Registerer)
	return c
}

func newPart(cfg Config) (*part, error) {
	f := promreg.With(cfg.Registerer)
	j := &part{
		cfg:     cfg,
		q:       newQueries(cfg.Schema),
		deleted: f.Counter("idem_janitor_deleted_total", "Rows the janitor deleted after their retention, by table (inbox, effects).", "schema", "table"),
		passes:  f.Counter("idem_janitor_passes_total", "Janitor passes, by result: ok, busy (another instance held the lock) or error.", "schema", "result"),
		lastOK:  f.Gauge("idem_janitor_last_success_timestamp_seconds", "Unix time when a janitor pass of this process last finished without error.", "schema"),
	}
	if err := f.Err(); err != nil {
		return nil, fmt.Errorf("register metrics: %w", err)
	}
	// Every series exists from the start, at 0, so that a dashboard sees the schema
	// before the first deletion and an alert on a janitor that never succeeded
	// (time() - idem_janitor_last_success_timestamp_seconds > 3600) fires instead
	// of finding no data.
	for _, table := range []string{"inbox", "effects"} {
		j.deleted.WithLabelValues(cfg.Schema, table)
	}
	for _, result := range []string{"ok", "busy", "error"} {
		j.passes.WithLabelValues(cfg.Schema, result)
	}
	j.lastOK.WithLabelValues(cfg.Schema)
	return j, nil
}

// Run runs a pass every Interval until ctx ends, then returns nil. A pass that
// finds the lock taken is skipped; a pass that fails is logged and tried again at
// the next interval, so a database restart does not stop the janitor. Use it inside
// a consumer or dispatcher process: `go janitor.Run(ctx)`. Over a shard map each
// shard has its own loop, so one shard down does not hold up the others.
func (j *Janitor) Run(ctx context.Context) error {
	return j.parts.Parallel(func(_ int, p *part) error { return p.run(ctx) })
}

// RunOnce runs one pass to completion: it deletes batches until no expired row is
// left, and returns what it deleted. It returns ErrBusy at once if another
// janitor is running a pass on the same schema. `idem gc` calls it. Over a shard
// map it passes over the shards one after another and adds up their Stats; a
// shard that fails, or whose lock another janitor holds, does not stop the others,
// and the error names each such shard.
func (j *Janitor) RunOnce(ctx context.Context) (Stats, error) {
	var total Stats
	start := time.Now()
	err := j.parts.Each(func(_ int, p *part) error {
		st, err := p.runOnce(ctx)
		total.InboxDeleted += st.InboxDeleted
		total.EffectsDeleted += st.EffectsDeleted
		total.Batches += st.Batches
		return err
	})
	total.Elapsed = time.Since(start)
	return total, err
}

func (j *part) run(ctx context.Context) error {
	log := j.cfg.Logger.With("schema", j.cfg.Schema)
	for {
		st, err := j.runOnce(ctx)
		switch {
		case ctx.Err() != nil:
			return nil
		case errors.Is(err, ErrBusy):
			log.Debug("idem: janitor pass skipped; another instance holds the lock")
		case err != nil:
			log.Warn("idem: janitor pass failed; trying again at the next interval", "err", err, "next_in", j.cfg.Interval)
		case st.Deleted() > 0:
			log.Info("idem: janitor pass done", "inbox_deleted", st.InboxDeleted, "effects_deleted", st.EffectsDeleted,
				"batches", st.Batches, "elapsed", st.Elapsed.Round(time.Millisecond))
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(j.cfg.Interval):
		}
	}
}

// runOnce runs one pass on the part's database.
func (j *part) runOnce(ctx context.Context) (st Stats, err error) {
	start := time.Now()
	defer func() {
		st.Elapsed = time.Since(start)
		switch {
		case errors.Is(err, ErrBusy):
			j.passes.WithLabelValues(j.cfg.Schema, "busy").Inc()
		case err != nil:
			j.passes.WithLabelValues(j.cfg.Schema, "error").Inc()
		default:
			j.passes.WithLabelValues(j.cfg.Schema, "ok").Inc()
			j.lastOK.WithLabelValues(j.cfg.Schema).SetToCurrentTime()
		}
	}()
	conn, err := j.cfg.Pool.Acquire(ctx)
	if err != nil {
		return st, err
	}
	var locked bool
	if err := conn.QueryRow(ctx, j.q.tryLock, j.cfg.Schema).Scan(&locked); err != nil {
		conn.Release()
		return st, err
	}
	if !locked {
		conn.Release()
		return st, ErrBusy
	}
	defer func() {
		// A session lock outlives the pass if the unlock fails (the context ended,
		// say); closing the connection is then the only sure way to drop it.
		uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if _, uerr := conn.Exec(uctx, j.q.unlock, j.cfg.Schema); uerr != nil {
			_ = conn.Hijack().Close(uctx)
			return
		}
		conn.Release()
	}()

	citus, err := j.citus.On(ctx, conn, pgschema.Table(j.cfg.Schema, "inbox"))
	if err != nil {
		return st, pgschema.Wrap(err, j.cfg.Schema)
	}
	deleteInbox, deleteDone, deleteDiscarded := j.q.deletes(citus)
	inboxDone, effectsDone, discardedDone := false, false, false
	limit := j.cfg.BatchSize
	for !inboxDone || !effectsDone || !discardedDone {
		if !inboxDone {
			tag, err := conn.Exec(ctx, deleteInbox, limit)
			if err != nil {
				return st, pgschema.Wrap(err, j.cfg.Schema)
			}
			n := tag.RowsAffected()
			inboxDone = n < int64(limit)
			j.count(&st, "inbox", n, &st.InboxDeleted)
		}
		if !effectsDone {
			tag, err := conn.Exec(ctx, deleteDone, limit, j.cfg.EffectsRetention)
			if err != nil {
				return st, pgschema.Wrap(err, j.cfg.Schema)
			}
			n := tag.RowsAffected()
			effectsDone = n < int64(limit)
			j.count(&st, "effects", n, &st.EffectsDeleted)
		}
		if !discardedDone {
			tag, err := conn.Exec(ctx, deleteDiscarded, limit, j.cfg.EffectsRetention)
			if err != nil {
				return st, pgschema.Wrap(err, j.cfg.Schema)
			}
			n := tag.RowsAffected()
			discardedDone = n < int64(limit)
			j.count(&st, "effects", n, &st.EffectsDeleted)
		}
		if j.cfg.OnBatch != nil {
			st.Elapsed = time.Since(start)
			j.cfg.OnBatch(st)
		}
		if (!inboxDone || !effectsDone || !discardedDone) && j.cfg.Pause > 0 {
			select {
			case <-ctx.Done():
				return st, ctx.Err()
			case <-time.After(j.cfg.Pause):
			}
		}
	}
	return st, nil
}

func (j *part) count(st *Stats, table string, n int64, total *int64) {
	if n == 0 {
		return
	}
	*total += n
	st.Batches++
	j.deleted.WithLabelValues(j.cfg.Schema, table).Add(float64(n))
}

// queries are the janitor's statements for one schema: the inbox's delete comes
// from the inbox table's statements, the effects' and the lock are its own.
type queries struct {
	inbox                                     inboxdb.Queries
	deleteDoneEffects, deleteDiscardedEffects string
	// The deletes of a schema on Citus (citusmode): by primary key, without row
	// locks across shards (see inboxdb's DeleteExpiredByKey).
	deleteDoneEffectsByKey, deleteDiscardedEffectsByKey string
	tryLock, unlock                                     string
}

// deletes are the statements of one pass: the expired inbox keys, the old done
// effects and the old discarded ones.
func (q queries) deletes(citus bool) (inbox, done, discarded string) {
	if citus {
		return q.inbox.DeleteExpiredByKey, q.deleteDoneEffectsByKey, q.deleteDiscardedEffectsByKey
	}
	return q.inbox.DeleteExpired, q.deleteDoneEffects, q.deleteDiscardedEffects
}

func newQueries(schema string) queries {
	e := pgschema.Table(schema, "effects")
	byKey := func(state string) string {
		return `DELETE FROM ` + e + ` WHERE (tenant, kind, key) IN (
				SELECT tenant, kind, key FROM ` + e + `
				WHERE state = '` + state + `' AND done_at < now() - $2::interval
				ORDER BY done_at
				LIMIT $1)
			AND state = '` + state + `' AND done_at < now() - $2::interval`
	}
	return queries{
		inbox: inboxdb.New(schema),
		// As the inbox's delete: a batch in done_at order through the partial
		// index effects_done_at_idx, deleted by ctid, SKIP LOCKED. Pending and
		// dead effects are never deleted.
		deleteDoneEffects: `DELETE FROM ` + e + ` WHERE ctid = ANY (ARRAY(
				SELECT ctid FROM ` + e + `
				WHERE state = 'done' AND done_at < now() - $2::interval
				ORDER BY done_at
				LIMIT $1
				FOR UPDATE SKIP LOCKED))
			AND state = 'done'`,
		// Discarded effects (an operator settled them unsent) go the same way,
		// through effects_discarded_idx.
		deleteDiscardedEffects: `DELETE FROM ` + e + ` WHERE ctid = ANY (ARRAY(
				SELECT ctid FROM ` + e + `
				WHERE state = 'discarded' AND done_at < now() - $2::interval
				ORDER BY done_at
				LIMIT $1
				FOR UPDATE SKIP LOCKED))
			AND state = 'discarded'`,
		deleteDoneEffectsByKey:      byKey("done"),
		deleteDiscardedEffectsByKey: byKey("discarded"),
		// One lock per schema, in the same key space as the migrator's lock.
		tryLock: `SELECT pg_try_advisory_lock(hashtextextended('idem.janitor:' || $1, 0))`,
		unlock:  `SELECT pg_advisory_unlock(hashtextextended('idem.janitor:' || $1, 0))`,
	}
}
