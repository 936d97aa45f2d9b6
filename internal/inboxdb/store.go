package inboxdb

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"bytes"

	"cmp"

	"github.com/idemkit/idem/internal/failgroup"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/text"
)

// DBTX is what the store runs statements on: a pgx.Tx, a *pgx.Conn or a pool.
type DBTX interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// State is an inbox row's state.
type State string

const (
	// StateCompleted is a key whose handler's work committed.
	StateCompleted State = "completed"
	// StateFailed is a key whose handler failed permanently; redeliveries replay
	// the failure.
	StateFailed State = "failed"
	// StateProcessing is a key a delivery holds until LeaseUntil (lease mode only).
	StateProcessing State = "processing"
)

// Record is one inbox row.
type Record struct {
	Consumer    string
	Tenant      string
	Key         string
	Fingerprint []byte
	State       State
	ErrorCode   string
	Error       string
	Attempts    int
	LeaseUntil  *time.Time
	Fence       int64
	ReceivedAt  time.Time
	CompletedAt *time.Time
	ExpiresAt   time.Time
	// Now is the database's clock when the row was read, so that callers compare
	// leases and ages with the server's time, never their own.
	Now time.Time
}

// ID names one inbox row.
type ID struct {
	Consumer string
	Tenant   string // "" means no tenant scope
	Key      string
}

// Validate checks the consumer, tenant and key.
func (id ID) Validate() error {
	if err := ValidateConsumer(id.Consumer); err != nil {
		return err
	}
	if err := ValidateTenant(id.Tenant); err != nil {
		return err
	}
	return ValidateKey(id.Key)
}

// Claim asks for one key.
type Claim struct {
	ID
	Fingerprint []byte
	// Retention is how long the row lives after it settles (DefaultRetention if 0).
	Retention time.Duration
}

// ClaimResult is what a claim found.
type ClaimResult struct {
	// Claimed: this caller owns the key now.
	Claimed bool
	// Existing is the row that was already there when Claimed is false. Its
	// fingerprint may differ from the claim's; see Mismatch.
	Existing *Record
	// Mismatch: the existing row has a different fingerprint (ErrFingerprintMismatch).
	Mismatch bool
	// Fence is the lease fence when Claimed in lease mode.
	Fence int64
	// Expired: the key had a settled (completed or failed) row past its
	// expires_at, which the claim deleted before claiming the key as new. A key past
	// its retention is forgotten whether or not the janitor has deleted its row yet.
	Expired bool
}

// Store runs the inbox's statements against the tables in one schema.
type Store struct {
	schema string
	q      Queries
}

// NewStore returns a Store for schema (pgschema.Default when empty).
func NewStore(schema string) (*Store, error) {
	schema = cmp.Or(schema, pgschema.Default)
	if err := pgschema.Validate(schema); err != nil {
		return nil, err
	}
	return &Store{schema: schema, q: New(schema)}, nil
}

// Schema is the store's schema name.
func (s *Store) Schema() string { return s.schema }

// retentionOf is a claim's retention, DefaultRetention when it has none.
func retentionOf(d time.Duration) time.Duration {
	if d <= 0 {
		return DefaultRetention
	}
	return d
}

// ClaimTx claims c.Key for the transactional mode, inside the caller's transaction,
// with one INSERT … ON CONFLICT DO NOTHING. The row is written as completed: it
// becomes visible only if the transaction commits, together with the handler's work.
//
// When another transaction holds an uncommitted claim of the same key, Postgres makes
// this insert wait for it (bounded by the caller's lock_timeout). If that transaction
// commits, the claim is a duplicate; if it rolls back, the claim succeeds. At READ
// COMMITTED the follow-up read sees the row that the wait ended on.
func (s *Store) ClaimTx(ctx context.Context, tx DBTX, c Claim) (ClaimResult, error) {
	if err := c.Validate(); err != nil {
		return ClaimResult{}, err
	}
	return s.insertOr(ctx, tx, c, func() (int64, error) {
		var inserted bool
		err := tx.QueryRow(ctx, s.q.Claim, c.Consumer, c.Tenant, c.Key, c.Fingerprint, retentionOf(c.Retention)).Scan(&inserted)
		return 0, err
	})
}

// insertOr runs insert, an INSERT … ON CONFLICT … RETURNING of c's row. A row back
// means the caller owns the key (with the fence insert returns). No row means a
// conflict: the next statement reads the row that was there, which at READ
// COMMITTED is the one a wait ended on. If that row was deleted between the two
// statements (a janitor, or a released lease), it inserts again. If it is a settled
// row past its expires_at, it deletes it, on db (in the caller's transaction, if
// db is one), and inserts again: the key is forgotten (Expired).
func (s *Store) insertOr(ctx context.Context, db DBTX, c Claim, insert func() (int64, error)) (ClaimResult, error) {
	expired := false
	for {
		fence, err := insert()
		if err == nil {
			return ClaimResult{Claimed: true, Fence: fence, Expired: expired}, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return ClaimResult{}, s.wrap(err)
		}
		rec, err := s.Get(ctx, db, c.ID)
		if errors.Is(err, ErrNotFound) {
			continue
		}
		if err != nil {
			return ClaimResult{}, err
		}
		if rec.Expired() {
			if _, err := db.Exec(ctx, s.q.DeleteExpiredKey, c.Consumer, c.Tenant, c.Key); err != nil {
				return ClaimResult{}, s.wrap(err)
			}
			expired = true
			continue
		}
		return s.existing(rec, c.Fingerprint), nil
	}
}

// Expired reports whether r is a settled (completed or failed) row past its
// expires_at, by the database's clock (Now): such a key is forgotten, and its next
// claim deletes the row and claims the key as new. A processing row never is.
func (r *Record) Expired() bool {
	return r.State != StateProcessing && r.ExpiresAt.Before(r.Now)
}

// BatchSender pipelines statements; pgx.Tx and *pgx.Conn do.
type BatchSender interface {
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// ClaimAfterTx is ClaimTx with statements sent ahead of the claim in the same round
// trip (a pgx pipeline), such as a SAVEPOINT or a SET LOCAL. Each statement must
// return no rows the caller needs. The conflict path reads the existing row with a
// second statement, as ClaimTx does.
func (s *Store) ClaimAfterTx(ctx context.Context, tx interface {
	DBTX
	BatchSender
}, prelude []string, c Claim) (ClaimResult, error) {
	if err := c.Validate(); err != nil {
		return ClaimResult{}, err
	}
	pipelined := false
	return s.insertOr(ctx, tx, c, func() (int64, error) {
		var inserted bool
		if pipelined { // a retry after the conflicting row vanished
			return 0, tx.QueryRow(ctx, s.q.Claim, c.Consumer, c.Tenant, c.Key, c.Fingerprint, retentionOf(c.Retention)).Scan(&inserted)
		}
		pipelined = true
		b := &pgx.Batch{}
		for _, sql := range prelude {
			b.Queue(sql)
		}
		b.Queue(s.q.Claim, c.Consumer, c.Tenant, c.Key, c.Fingerprint, retentionOf(c.Retention))
		br := tx.SendBatch(ctx, b)
		for range prelude {
			if _, err := br.Exec(); err != nil {
				_ = br.Close()
				return 0, err
			}
		}
		err := br.QueryRow().Scan(&inserted)
		if cerr := br.Close(); err == nil && cerr != nil {
			err = cerr
		}
		return 0, err
	})
}

func (s *Store) existing(rec *Record, fp []byte) ClaimResult {
	return ClaimResult{Existing: rec, Mismatch: !bytes.Equal(rec.Fingerprint, fp)}
}

// FailTx records a permanent failure for c.Key, unless the key already has a row. It
// returns whether it wrote the row. Call it in a transaction of its own, after the
// handler's transaction rolled back, so that nothing of the failed work is kept.
// code and msg are sanitised (valid UTF-8, no NUL bytes), so any bytes are accepted.
func (s *Store) FailTx(ctx context.Context, tx DBTX, c Claim, code, msg string) (ClaimResult, error) {
	if err := c.Validate(); err != nil {
		return ClaimResult{}, err
	}
	code, msg = text.Sanitize(code, 0), text.Sanitize(msg, 0)
	return s.insertOr(ctx, tx, c, func() (int64, error) {
		var inserted bool
		err := tx.QueryRow(ctx, s.q.Fail, c.Consumer, c.Tenant, c.Key, c.Fingerprint, retentionOf(c.Retention), code, msg, failgroup.Mask(msg)).Scan(&inserted)
		return 0, err
	})
}

// Get reads one inbox row, or returns ErrNotFound.
func (s *Store) Get(ctx context.Context, db DBTX, id ID) (*Record, error) {
	var r Record
	var code, msg *string
	err := db.QueryRow(ctx, s.q.Get, id.Consumer, id.Tenant, id.Key).Scan(
		&r.Consumer, &r.Tenant, &r.Key, &r.Fingerprint, &r.State, &code, &msg, &r.Attempts,
		&r.LeaseUntil, &r.Fence, &r.ReceivedAt, &r.CompletedAt, &r.ExpiresAt, &r.Now)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, ErrNotFound
	}
	if err != nil {
		return nil, s.wrap(err)
	}
	if code != nil {
		r.ErrorCode = *code
	}
	if msg != nil {
		r.Error = *msg
	}
	return &r, nil
}

// Lease claims c.Key for lease mode and commits at once (db should be a pool or a
// connection outside a transaction). It inserts a processing row with a lease, or
// atomically takes over a processing row whose lease has run out, bumping its fence.
// A fresh lease held by someone else is returned as Existing with State processing.
func (s *Store) Lease(ctx context.Context, db DBTX, c Claim, lease time.Duration) (ClaimResult, error) {
	if err := c.Validate(); err != nil {
		return ClaimResult{}, err
	}
	return s.insertOr(ctx, db, c, func() (int64, error) {
		var fence int64
		err := db.QueryRow(ctx, s.q.Lease, c.Consumer, c.Tenant, c.Key, c.Fingerprint, retentionOf(c.Retention), lease).Scan(&fence)
		return fence, err
	})
}

// CompleteLeaseTx marks a leased key completed, in the caller's transaction (the one
// that holds the handler's work), if the fence still matches. Otherwise it returns
// ErrLeaseLost and the caller must roll back.
func (s *Store) CompleteLeaseTx(ctx context.Context, tx DBTX, id ID, fence int64, retention time.Duration) error {
	tag, err := tx.Exec(ctx, s.q.CompleteLease, id.Consumer, id.Tenant, id.Key, fence, retentionOf(retention))
	if err != nil {
		return s.wrap(err)
	}
	if tag.RowsAffected() == 0 {
		return ErrLeaseLost
	}
	return nil
}

// FailLease records a permanent failure on a leased key if the fence still matches.
// code and msg are sanitised (valid UTF-8, no NUL bytes), so any bytes are accepted.
func (s *Store) FailLease(ctx context.Context, db DBTX, id ID, fence int64, retention time.Duration, code, msg string) error {
	code, msg = text.Sanitize(code, 0), text.Sanitize(msg, 0)
	tag, err := db.Exec(ctx, s.q.FailLease, id.Consumer, id.Tenant, id.Key, fence, retentionOf(retention), code, msg, failgroup.Mask(msg))
	if err != nil {
		return s.wrap(err)
	}
	if tag.RowsAffected() == 0 {
		return ErrLeaseLost
	}
	return nil
}

// ReleaseLease ends a lease early after a transient failure, so that the next
// delivery takes the key over at once instead of waiting out the lease.
func (s *Store) ReleaseLease(ctx context.Context, db DBTX, id ID, fence int64) error {
	_, err := db.Exec(ctx, s.q.ReleaseLease, id.Consumer, id.Tenant, id.Key, fence)
	return s.wrap(err)
}

// DeleteExpired deletes up to limit completed or failed rows whose expires_at has
// passed, oldest expiry first, and returns how many it deleted. It never deletes
// processing rows, and skips rows that another transaction has locked. Janitor
// runs it in batches; call it yourself only to build a cleanup of your own.
func (s *Store) DeleteExpired(ctx context.Context, db DBTX, limit int) (int64, error) {
	tag, err := db.Exec(ctx, s.q.DeleteExpired, limit)
	if err != nil {
		return 0, s.wrap(err)
	}
	return tag.RowsAffected(), nil
}

// wrap turns a missing table into ErrSchemaMissing, which says what to do.
func (s *Store) wrap(err error) error { return pgschema.Wrap(err, s.schema) }
