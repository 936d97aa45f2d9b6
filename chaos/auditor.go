package chaos

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"cmp"

	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/pgschema"
)

// querier runs the Auditor's queries; *pgxpool.Pool, *pgx.Conn and pgx.Tx do.
type querier = interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

var (
	// ErrInvalidConfig is wrapped by the error a constructor of this package
	// returns for a config it refuses (code "invalid_config"). Every idem package
	// has the same value.
	ErrInvalidConfig = errcode.ErrInvalidConfig

	// ErrNotOneSnapshot is returned by Report when its Pool cannot begin a
	// transaction (it is not a pool or a connection) and is not a REPEATABLE READ
	// or SERIALIZABLE transaction: each of the report's queries would read its own
	// snapshot. Give the Auditor a pool, or a transaction begun with
	// pgx.TxOptions{IsoLevel: pgx.RepeatableRead}.
	ErrNotOneSnapshot = errcode.Permanent("audit_not_one_snapshot",
		"chaos: the Auditor's Pool is a READ COMMITTED transaction, so each query would read its own snapshot: give the Auditor a pool, or a transaction begun with pgx.TxOptions{IsoLevel: pgx.RepeatableRead}")
)

// Auditor reads idem's inbox and effects tables, and the counts a test supplies,
// and says whether every message committed once and every effect was carried out.
// A report's reads of its database are one snapshot (see Report).
type Auditor struct {
	cfg     AuditorConfig
	db      querier
	schema  string
	queries auditQueries
	// betweenReads, when set (by tests), runs after a report has read the inbox
	// and before it reads the business rows.
	betweenReads func()
}

// AuditorConfig says which idem tables an Auditor reads.
type AuditorConfig struct {
	// Pool runs the Auditor's queries: a *pgxpool.Pool or a *pgx.Conn, on which
	// each report begins a REPEATABLE READ, READ ONLY transaction, or a pgx.Tx at
	// REPEATABLE READ or SERIALIZABLE, whose snapshot every report reads.
	// Required.
	Pool interface {
		Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	}
	// Schema holds the idem tables (DefaultSchema when empty).
	Schema string
	// SettlePoll is the time between the audits of Settled (default 50 ms).
	SettlePoll time.Duration
	// SettleQuiet: if the figures stop changing for this long, Settled takes the
	// run as settled even with failures in it (default 2 s), so a run that lost
	// messages ends with a report instead of waiting for its deadline.
	SettleQuiet time.Duration
}

// WithDefaults returns c with every unset field at its default.
func (c AuditorConfig) WithDefaults() AuditorConfig {
	c.Schema = cmp.Or(c.Schema, DefaultSchema)
	c.SettlePoll = cmp.Or(c.SettlePoll, DefaultSettlePoll)
	c.SettleQuiet = cmp.Or(c.SettleQuiet, DefaultSettleQuiet)
	return c
}

// Validate reports what NewAuditor would refuse in c: no Pool, a bad schema name
// (the empty schema is the default), or a negative SettlePoll or SettleQuiet.
func (c AuditorConfig) Validate() error {
	c = c.WithDefaults()
	if c.SettlePoll < 0 || c.SettleQuiet < 0 {
		return errcode.InvalidConfig("SettlePoll and SettleQuiet must not be negative")
	}
	return pgschema.ValidateDB(c.Pool, c.Schema)
}

// NewAuditor returns an Auditor of the idem tables in cfg.Schema, or an error that
// wraps "invalid config".
func NewAuditor(cfg AuditorConfig) (*Auditor, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	return &Auditor{cfg: cfg, db: cfg.Pool, schema: cfg.Schema, queries: newAuditQueries(cfg.Schema)}, nil
}

// AuditQuery says what to audit.
type AuditQuery struct {
	// Consumer is the inbox consumer name; Tenant its tenant scope ("" for none).
	Consumer string
	Tenant   string
	// ExpectedKeys are the keys that must each commit once: the message UUIDs, or
	// the business keys if the consumer uses those. Without them the Auditor can
	// only count what is there, not what is missing.
	ExpectedKeys []string

	// BusinessCount returns, per key, how many times the business operation
	// committed (for example, ledger rows per payment). It is the ground truth for
	// "committed once". BusinessSQL is the same as a query returning (key text,
	// count bigint); it is your own SQL, run as it is, in the report's snapshot.
	// Set at most one. Without either, the inbox's completed rows stand in for
	// business commits.
	//
	// Use BusinessSQL when the business rows are in the audited database.
	// BusinessCount is for rows elsewhere (another database, a shard map, memory):
	// it is called before the snapshot is taken, so a consumer commit in between
	// shows as a key not committed yet, and business rows that run ahead of the
	// inbox as parts that disagree (Report.Inconsistent): either report is not OK.
	BusinessCount func(ctx context.Context) (map[string]int, error)
	BusinessSQL   string

	// WithoutInbox says the consumer keeps no idem inbox (a peer such as
	// Watermill's Deduplicator): the inbox is not read, and business commits are
	// not checked against inbox rows.
	WithoutInbox bool

	// EffectKind and EffectKey name the effect each expected key must have made:
	// kind EffectKind with key EffectKey(key), for example "email" and
	// "receipt:"+key. Unset: effects are counted but not matched to keys.
	EffectKind string
	EffectKey  func(key string) string

	// SendKey gives the key under which Sends counts an expected key's effect
	// (default EffectKey). Set it without EffectKind to audit sends of a consumer
	// that makes no effect rows, such as a peer without idem.
	SendKey func(key string) string

	// Sends returns, per effect key, how many times the outside world received
	// the effect (for example, emails per Message-ID at an SMTP receiver). More
	// than one is possible when a sender was killed mid-send; none, for a done
	// effect, is a lost effect. It is called after the snapshot: a send comes
	// before its effect is marked done, so every effect done in the snapshot was
	// sent before the call.
	Sends func(ctx context.Context) (map[string]int, error)

	// Deliveries is how many deliveries the consumer saw (for example
	// Subscriber.Stats().Delivered) and DuplicatesSuppressed how many of them it
	// turned into duplicates (idem_inbox_duplicates_total). The Auditor cannot
	// read either from Postgres; they are printed as given, and a negative value
	// prints as "-" (not measured). They are values, read when the query is
	// built: for Settled, set them on the report it returns (Report.Deliveries),
	// read once the run has settled.
	Deliveries           int64
	DuplicatesSuppressed int64
}

// Report audits once. Its reads of the audited database (the inbox, BusinessSQL
// and the effects) are one snapshot: one REPEATABLE READ, READ ONLY transaction
// on a pool or connection, or the snapshot of the pgx.Tx the Auditor was given
// (ErrNotOneSnapshot if that is READ COMMITTED). BusinessCount is called before
// the snapshot and Sends after it. Keys whose parts disagree make the report not
// OK (Report.Inconsistent).
//
// On Citus (the Pool on the coordinator) there is no snapshot across workers:
// Citus begins the transaction on each worker when a read first reaches it. The
// inbox read names the tenant (AuditQuery.Tenant), so it fixes the snapshot of
// the tenant's shards, and Citus reads them, and the shards colocated with them,
// over the same connection for the rest of the transaction: the report reads the
// tenant's inbox, effect and business rows in one snapshot when BusinessSQL reads
// a table distributed by tenant and colocated with the inbox. The rows it reads on
// other workers are in those workers' own snapshots.
func (a *Auditor) Report(ctx context.Context, q AuditQuery) (Report, error) {
	if q.BusinessCount != nil && q.BusinessSQL != "" {
		return Report{}, errors.New("chaos: set BusinessCount or BusinessSQL, not both")
	}
	if (q.EffectKind == "") != (q.EffectKey == nil) {
		return Report{}, errors.New("chaos: EffectKind and EffectKey go together")
	}
	r := Report{Consumer: q.Consumer, Deliveries: q.Deliveries, DuplicatesSuppressed: q.DuplicatesSuppressed}

	var business map[string]int
	var err error
	if q.BusinessCount != nil {
		if business, err = q.BusinessCount(ctx); err != nil {
			return r, fmt.Errorf("chaos: business count: %w", err)
		}
	}
	inbox := map[string]string{}
	var effects effectStates
	err = a.inSnapshot(ctx, func(db querier) error {
		if !q.WithoutInbox {
			if inbox, err = a.inboxStates(ctx, db, q); err != nil {
				return err
			}
		}
		if a.betweenReads != nil {
			a.betweenReads()
		}
		if q.BusinessSQL != "" {
			if business, err = keyCounts(ctx, db, q.BusinessSQL); err != nil {
				return fmt.Errorf("chaos: business count: %w", err)
			}
		}
		effects, err = a.effectStates(ctx, db, q)
		return err
	})
	if err != nil {
		return r, err
	}
	for _, st := range inbox {
		switch st {
		case "completed":
			r.InboxCompleted++
		case "failed":
			r.InboxFailed++
		case "processing":
			r.InboxProcessing++
		}
	}
	r.businessUnknown = business == nil
	if r.businessUnknown {
		business = map[string]int{}
		for k, st := range inbox {
			if st == "completed" {
				business[k] = 1
			}
		}
	}

	expected := q.ExpectedKeys
	if expected == nil {
		for k := range inbox {
			expected = append(expected, k)
		}
		slices.Sort(expected)
	}
	r.Messages = len(expected)
	want := make(map[string]bool, len(expected))
	for _, k := range expected {
		if want[k] {
			continue
		}
		want[k] = true
		switch n := business[k]; {
		case n == 1:
			r.CommittedOnce++
		case n > 1:
			r.CommittedTwice++
			r.DuplicatedKeys = sample(r.DuplicatedKeys, k)
		case inbox[k] == "failed":
			r.Failed++
		default:
			r.Lost++
			r.LostKeys = sample(r.LostKeys, k)
		}
	}
	for k, n := range business {
		if n > 0 && !want[k] {
			r.Unexpected++
		}
	}

	for _, e := range effects.bySource {
		switch e {
		case "done":
			r.EffectsDone++
		case "dead":
			r.EffectsDead++
		case "pending":
			r.EffectsPending++
		}
	}

	var sends map[string]int
	r.sendsUnknown = q.Sends == nil
	if q.Sends != nil {
		if sends, err = q.Sends(ctx); err != nil {
			return r, fmt.Errorf("chaos: sends: %w", err)
		}
		for _, n := range sends {
			r.SendsTotal += n
		}
	}
	sendKey := q.SendKey
	if sendKey == nil {
		sendKey = q.EffectKey
	}
	r.effectsUnknown = q.EffectKey == nil
	seen := make(map[string]bool, len(expected))
	for _, k := range expected {
		if seen[k] {
			continue
		}
		seen[k] = true
		st, hasEffect := "", false
		if q.EffectKey != nil {
			st, hasEffect = effects.byKey[q.EffectKey(k)]
		}
		if why := disagreement(q, k, business[k], inbox[k], st, hasEffect); why != "" {
			r.Inconsistent++
			r.InconsistentKeys = sample(r.InconsistentKeys, why)
		}
		if inbox[k] == "failed" && business[k] == 0 {
			continue // a recorded permanent failure makes no effect
		}
		if q.EffectKey != nil && !hasEffect {
			r.EffectsMissing++
			r.MissingEffectKeys = sample(r.MissingEffectKeys, q.EffectKey(k))
		}
		if sends == nil || sendKey == nil {
			continue
		}
		switch n := sends[sendKey(k)]; {
		case n == 1:
			r.SendsOnce++
		case n > 1:
			r.SendsRepeated++
		case st != "dead" && st != "pending":
			r.SendsMissing++
			r.MissingSendKeys = sample(r.MissingSendKeys, sendKey(k))
		}
	}
	return r, nil
}

// disagreement says how key k's parts disagree, or returns "": an idem consumer
// commits a key's business rows, its completed inbox row and its effect rows in
// one transaction, so each of them is there exactly when the others are.
// Committed n times, the key needs a completed inbox row (unless the consumer
// has none); not committed, it has no effect row. A completed inbox row with no
// commit is already a lost key, and a commit with no effect row a missing
// effect.
func disagreement(q AuditQuery, k string, n int, inboxState, effectState string, hasEffect bool) string {
	switch {
	case n > 0 && !q.WithoutInbox && inboxState != "completed":
		return fmt.Sprintf("%s: committed %d, inbox row %s", k, n, cmp.Or(inboxState, "none"))
	case n == 0 && hasEffect:
		return fmt.Sprintf("%s: not committed, effect %s %s", k, q.EffectKey(k), effectState)
	}
	return ""
}

// inSnapshot runs read with a querier whose queries all read one snapshot of
// the Auditor's database.
func (a *Auditor) inSnapshot(ctx context.Context, read func(db querier) error) error {
	if b, ok := a.db.(interface {
		BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
	}); ok {
		tx, err := b.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
		if err != nil {
			return fmt.Errorf("chaos: begin the audit's snapshot: %w", err)
		}
		defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
		return read(tx)
	}
	// A transaction the caller began: its isolation decides whether it is one
	// snapshot.
	rows, err := a.db.Query(ctx, `SELECT current_setting('transaction_isolation')`)
	if err != nil {
		return fmt.Errorf("chaos: read the audit's isolation: %w", err)
	}
	iso, err := pgx.CollectExactlyOneRow(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("chaos: read the audit's isolation: %w", err)
	}
	if iso != "repeatable read" && iso != "serializable" {
		return ErrNotOneSnapshot
	}
	return read(a.db)
}

// Settled audits until the run is settled (nothing pending or processing) with a
// report that is OK, or its figures stop changing for AuditorConfig.SettleQuiet,
// or ctx ends, auditing every AuditorConfig.SettlePoll. It
// returns the last report, and ctx's error in the last case. A report whose parts
// disagree is not OK, so it ends Settled only through Quiet, and then as a
// failing report that says which keys disagree.
func (a *Auditor) Settled(ctx context.Context, q AuditQuery) (Report, error) {
	poll, quiet := a.cfg.SettlePoll, a.cfg.SettleQuiet
	var last Report
	var since time.Time
	for {
		r, err := a.Report(ctx, q)
		if err != nil && ctx.Err() == nil {
			return r, err
		}
		if err == nil {
			if r.Settled() && r.OK() {
				return r, nil
			}
			if !sameFigures(r, last) {
				last, since = r, time.Now()
			} else if time.Since(since) >= quiet && r.Settled() {
				return r, nil
			}
		}
		select {
		case <-ctx.Done():
			return last, fmt.Errorf("chaos: not settled: %w", ctx.Err())
		case <-time.After(poll):
		}
	}
}

func sameFigures(a, b Report) bool {
	a.LostKeys, a.DuplicatedKeys, a.MissingEffectKeys, a.MissingSendKeys, a.InconsistentKeys = nil, nil, nil, nil, nil
	b.LostKeys, b.DuplicatedKeys, b.MissingEffectKeys, b.MissingSendKeys, b.InconsistentKeys = nil, nil, nil, nil, nil
	return fmt.Sprint(a) == fmt.Sprint(b)
}

// auditQueries is the Auditor's SQL, with the schema quoted in once.
type auditQueries struct {
	inbox, effectsBySource, effectsByKind string
}

func newAuditQueries(schema string) auditQueries {
	s := pgx.Identifier{schema}.Sanitize()
	return auditQueries{
		inbox: `SELECT key, state FROM ` + s + `.inbox WHERE consumer = $1 AND tenant = $2`,
		effectsBySource: `SELECT kind, key, state FROM ` + s + `.effects
			WHERE source_consumer = $1 AND coalesce(source_tenant, '') = $2`,
		// Effect keys are scoped by tenant (migration 002): another tenant's effect
		// with the same kind and key is not this tenant's.
		effectsByKind: `SELECT kind, key, state FROM ` + s + `.effects WHERE kind = $1 AND tenant = $2`,
	}
}

func (a *Auditor) inboxStates(ctx context.Context, db querier, q AuditQuery) (map[string]string, error) {
	rows, err := db.Query(ctx, a.queries.inbox, q.Consumer, q.Tenant)
	if err != nil {
		return nil, fmt.Errorf("chaos: read inbox: %w", err)
	}
	m := map[string]string{}
	var k, st string
	_, err = pgx.ForEachRow(rows, []any{&k, &st}, func() error { m[k] = st; return nil })
	if err != nil {
		return nil, fmt.Errorf("chaos: read inbox: %w", err)
	}
	return m, nil
}

type effectStates struct {
	bySource map[[2]string]string // (kind, key) -> state, of the consumer's effects in its tenant
	byKey    map[string]string    // key -> state, of the expected kind in the audited tenant
}

func (a *Auditor) effectStates(ctx context.Context, db querier, q AuditQuery) (effectStates, error) {
	es := effectStates{bySource: map[[2]string]string{}, byKey: map[string]string{}}
	var kind, key, st string
	rows, err := db.Query(ctx, a.queries.effectsBySource, q.Consumer, q.Tenant)
	if err == nil {
		_, err = pgx.ForEachRow(rows, []any{&kind, &key, &st}, func() error {
			es.bySource[[2]string{kind, key}] = st
			return nil
		})
	}
	if err == nil && q.EffectKind != "" {
		rows, err = db.Query(ctx, a.queries.effectsByKind, q.EffectKind, q.Tenant)
		if err == nil {
			_, err = pgx.ForEachRow(rows, []any{&kind, &key, &st}, func() error {
				es.byKey[key] = st
				return nil
			})
		}
	}
	if err != nil {
		return es, fmt.Errorf("chaos: read effects: %w", err)
	}
	return es, nil
}

// keyCounts runs a query returning (key, count).
func keyCounts(ctx context.Context, db querier, sql string) (map[string]int, error) {
	rows, err := db.Query(ctx, sql)
	if err != nil {
		return nil, err
	}
	m := map[string]int{}
	var k string
	var n int64
	_, err = pgx.ForEachRow(rows, []any{&k, &n}, func() error { m[k] += int(n); return nil })
	return m, err
}
