package inbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
)

// Janitor defaults.
const (
	// DefaultJanitorBatchSize is how many rows one DELETE removes. Small batches keep
	// each transaction short, so a concurrent claim never waits long on it.
	DefaultJanitorBatchSize = 2000
	// DefaultJanitorPause is the pause between two batches, which leaves room for
	// the other traffic and for autovacuum.
	DefaultJanitorPause = 5 * time.Millisecond
	// DefaultJanitorInterval is the time between two passes of Run.
	DefaultJanitorInterval = time.Minute
	// DefaultEffectsRetention is how long done effects are kept after done_at.
	DefaultEffectsRetention = 7 * 24 * time.Hour
)

// JanitorConfig configures a Janitor.
type JanitorConfig struct {
	// Pool runs the deletes. Required. The janitor holds one of its connections
	// for a whole pass, because the advisory lock belongs to that session.
	Pool *pgxpool.Pool
	// Schema holds the idem tables (default "idem").
	Schema string
	// BatchSize is the most rows one DELETE removes (default 2000).
	BatchSize int
	// Pause is the wait between batches (default 5 ms). A negative Pause means none.
	Pause time.Duration
	// EffectsRetention is how long done effects stay after done_at (default 7
	// days). Pending and dead effects are never deleted.
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

func (c *JanitorConfig) setDefaults() {
	c.Schema = cmp.Or(c.Schema, DefaultSchema)
	c.BatchSize = cmp.Or(c.BatchSize, DefaultJanitorBatchSize)
	c.Pause = cmp.Or(c.Pause, DefaultJanitorPause)
	c.EffectsRetention = cmp.Or(c.EffectsRetention, DefaultEffectsRetention)
	c.Interval = cmp.Or(c.Interval, DefaultJanitorInterval)
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
}

// Validate checks the config after defaults.
func (c *JanitorConfig) Validate() error {
	if c.Pool == nil {
		return errors.New("Pool is required")
	}
	if err := ValidateSchema(c.Schema); err != nil {
		return err
	}
	if c.BatchSize < 1 || c.BatchSize > 100_000 {
		return fmt.Errorf("BatchSize %d is outside 1..100000", c.BatchSize)
	}
	if c.EffectsRetention < time.Minute {
		return fmt.Errorf("EffectsRetention %s is under a minute", c.EffectsRetention)
	}
	if c.Interval < time.Millisecond {
		return fmt.Errorf("Interval %s is under a millisecond", c.Interval)
	}
	return nil
}

// Stats is what one janitor pass did.
type Stats struct {
	// InboxDeleted counts expired completed and failed inbox rows deleted.
	InboxDeleted int64
	// EffectsDeleted counts done effects deleted after their retention.
	EffectsDeleted int64
	// Batches counts the DELETE statements that removed at least one row.
	Batches int
	// Elapsed is the pass's duration.
	Elapsed time.Duration
}

// Deleted is the total number of rows deleted.
func (s Stats) Deleted() int64 { return s.InboxDeleted + s.EffectsDeleted }

// Janitor deletes what the retention lets go: inbox rows in state completed or
// failed whose expires_at has passed, and effects in state done whose done_at is
// older than EffectsRetention. It never deletes processing inbox rows, nor pending
// or dead effects: those are work not yet settled.
//
// It deletes in batches of BatchSize, each its own short transaction, with Pause
// between them. The rows are picked in expiry order through the partial indexes
// that the migrations create for this, and locked with SKIP LOCKED, so the janitor
// never waits on a row that someone else holds.
//
// A Postgres advisory lock (per schema) keeps it to one running pass at a time
// across all processes, so every consumer and dispatcher process may run one.
//
// The janitor lives in inbox because the inbox migrations own both tables; it
// deletes effects with plain SQL against the same schema and imports nothing else
// of idem.
type Janitor struct {
	cfg     JanitorConfig
	q       queries
	deleted *prometheus.CounterVec
	passes  *prometheus.CounterVec
	lastOK  *prometheus.GaugeVec
}

// ErrJanitorBusy: another janitor holds the schema's advisory lock and is running a
// pass. It is not a failure: that janitor does the work.
var ErrJanitorBusy = newError("janitor_busy", "another janitor is running a pass on this schema (it holds the advisory lock)", false)

// NewJanitor validates cfg and returns a Janitor.
func NewJanitor(cfg JanitorConfig) (*Janitor, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	j := &Janitor{
		cfg: cfg,
		q:   newQueries(quoteIdent(cfg.Schema)),
		deleted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idem_janitor_deleted_total",
			Help: "Rows the janitor deleted after their retention, by table (inbox, effects).",
		}, []string{"schema", "table"}),
		passes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idem_janitor_passes_total",
			Help: "Janitor passes, by result: ok, busy (another instance held the lock) or error.",
		}, []string{"schema", "result"}),
		lastOK: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "idem_janitor_last_success_timestamp_seconds",
			Help: "Unix time when a janitor pass of this process last finished without error.",
		}, []string{"schema"}),
	}
	var err error
	if j.deleted, err = registerAs(cfg.Registerer, j.deleted); err != nil {
		return nil, fmt.Errorf("register metrics: %w", err)
	}
	if j.passes, err = registerAs(cfg.Registerer, j.passes); err != nil {
		return nil, fmt.Errorf("register metrics: %w", err)
	}
	if j.lastOK, err = registerAs(cfg.Registerer, j.lastOK); err != nil {
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
// a consumer or dispatcher process: `go janitor.Run(ctx)`.
func (j *Janitor) Run(ctx context.Context) error {
	log := j.cfg.Logger.With("schema", j.cfg.Schema)
	for {
		st, err := j.RunOnce(ctx)
		switch {
		case ctx.Err() != nil:
			return nil
		case errors.Is(err, ErrJanitorBusy):
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

// RunOnce runs one pass to completion: it deletes batches until no expired row is
// left, and returns what it deleted. It returns ErrJanitorBusy at once if another
// janitor is running a pass on the same schema. `idem gc` calls it.
func (j *Janitor) RunOnce(ctx context.Context) (st Stats, err error) {
	start := time.Now()
	defer func() {
		st.Elapsed = time.Since(start)
		switch {
		case errors.Is(err, ErrJanitorBusy):
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
	if err := conn.QueryRow(ctx, j.q.janitorTryLock, j.cfg.Schema).Scan(&locked); err != nil {
		conn.Release()
		return st, err
	}
	if !locked {
		conn.Release()
		return st, ErrJanitorBusy
	}
	defer func() {
		// A session lock outlives the pass if the unlock fails (the context ended,
		// say); closing the connection is then the only sure way to drop it.
		uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if _, uerr := conn.Exec(uctx, j.q.janitorUnlock, j.cfg.Schema); uerr != nil {
			_ = conn.Hijack().Close(uctx)
			return
		}
		conn.Release()
	}()

	inboxDone, effectsDone := false, false
	limit := j.cfg.BatchSize
	for !inboxDone || !effectsDone {
		if !inboxDone {
			tag, err := conn.Exec(ctx, j.q.deleteExpired, limit)
			if err != nil {
				return st, wrapSchema(err, j.cfg.Schema)
			}
			n := tag.RowsAffected()
			inboxDone = n < int64(limit)
			j.count(&st, "inbox", n, &st.InboxDeleted)
		}
		if !effectsDone {
			tag, err := conn.Exec(ctx, j.q.deleteDoneEffects, limit, j.cfg.EffectsRetention)
			if err != nil {
				return st, wrapSchema(err, j.cfg.Schema)
			}
			n := tag.RowsAffected()
			effectsDone = n < int64(limit)
			j.count(&st, "effects", n, &st.EffectsDeleted)
		}
		if j.cfg.OnBatch != nil {
			st.Elapsed = time.Since(start)
			j.cfg.OnBatch(st)
		}
		if (!inboxDone || !effectsDone) && j.cfg.Pause > 0 {
			select {
			case <-ctx.Done():
				return st, ctx.Err()
			case <-time.After(j.cfg.Pause):
			}
		}
	}
	return st, nil
}

func (j *Janitor) count(st *Stats, table string, n int64, total *int64) {
	if n == 0 {
		return
	}
	*total += n
	st.Batches++
	j.deleted.WithLabelValues(j.cfg.Schema, table).Add(float64(n))
}

func wrapSchema(err error, schema string) error {
	if errIsUndefinedTable(err) {
		return fmt.Errorf("%w (schema %q): %v", ErrSchemaMissing, schema, err)
	}
	return err
}

// registerAs registers c, or returns the collector already registered under the
// same name, so that two janitors on one registry share their metrics.
func registerAs[T prometheus.Collector](reg prometheus.Registerer, c T) (T, error) {
	if reg == nil {
		return c, nil
	}
	err := reg.Register(c)
	var are prometheus.AlreadyRegisteredError
	if errors.As(err, &are) {
		if existing, ok := are.ExistingCollector.(T); ok {
			return existing, nil
		}
	}
	return c, err
}
