package consumer

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/idem/internal/citusmode"
	"github.com/idemkit/idem/internal/txmark"
)

// A handler holds idem's transaction and can end it with raw SQL
// (tx.Exec(ctx, "COMMIT"), "ROLLBACK", even "COMMIT; BEGIN"). pgx's Tx cannot see
// that, and a COMMIT sent afterwards would report success for a transaction that is
// gone or is the handler's own. So every transaction idem begins carries a mark
// (internal/txmark), and idem checks two things before a commit:
//
//   - after the handler returns, the connection's transaction status (pgconn's
//     TxStatus, from the last ReadyForQuery, free to read) must be 'T'. 'I' means
//     the handler ended the transaction; 'E' that a statement failed and the handler
//     returned nil anyway.
//   - COMMIT is sent as "SELECT <mark check>; COMMIT" in one simple query. If the
//     mark is gone (the handler ended the transaction and began another), the check
//     raises an error, Postgres skips the COMMIT of the same query string, and the
//     handler's new transaction is rolled back.
//
// The mark is set in the claim's round trip (with SET LOCAL lock_timeout, pipelined)
// and checked in the COMMIT round trip (pgx's TxOptions.CommitQuery), so it costs no
// round trip of its own in Transactional and GroupCommit mode. In GroupCommit mode
// each message's savepoint is a second mark: the next statement idem sends, RELEASE
// SAVEPOINT, fails if the handler's transaction is not the one that savepoint was
// made in.
const (
	commitSQL = txmark.Check + "; COMMIT"
	// groupCommitSQL is the COMMIT of a group-commit batch. It also sets idem.commit,
	// the one thing that lets the commit guard (migration 004) pass: a batch claims
	// all of its keys before its handlers run, so a COMMIT that a handler sent
	// itself must fail rather than commit the claims of messages whose handlers have
	// not run. The guard row goes in with the batch's first statements (guardSQL).
	groupCommitSQL = txmark.Check + "; SET LOCAL idem.commit = 'on'; COMMIT"
	// groupCommitCitusSQL is groupCommitSQL on Citus. The commit guard runs on the
	// coordinator (its table stays there), so idem.commit need not reach the
	// workers, and propagating a SET LOCAL sent in COMMIT's own query fails that
	// COMMIT in Citus 13.2 once the transaction has made savepoints ("RELEASE
	// SAVEPOINT can only be used in transaction blocks"): propagation is turned
	// off first.
	groupCommitCitusSQL = txmark.Check + "; " + citusmode.StopPropagating + "; SET LOCAL idem.commit = 'on'; COMMIT"
)

// guardSQL is the statement that arms the commit guard of a batch's transaction.
func guardSQL(schema string) string {
	return "INSERT INTO " + pgx.Identifier{schema, "commit_guard"}.Sanitize() + " DEFAULT VALUES"
}

// begin starts a transaction whose COMMIT checks the mark. The caller sets the mark
// (txmark.Mark) before anything else.
func (c *engine) begin(ctx context.Context) (pgx.Tx, error) {
	return c.cfg.Pool.BeginTx(ctx, c.txOptions(ctx, commitSQL))
}

// beginGroup starts a group-commit batch's transaction: its COMMIT checks the mark
// and lets the commit guard pass.
func (c *engine) beginGroup(ctx context.Context) (pgx.Tx, error) {
	return c.cfg.Pool.BeginTx(ctx, c.txOptions(ctx, groupCommitSQL))
}

// txOptions are the options of a transaction of c that commits with commitQuery
// (pgx's default COMMIT when empty). On Citus (citusmode: the schema's inbox is
// distributed, asked once) its BEGIN also sends citusmode.PropagateSet in the same
// round trip, so that the SET LOCAL statements that follow (lock_timeout, the
// marks) reach the workers too, and a group-commit batch commits with
// groupCommitCitusSQL. A question that fails (most likely the database is
// unreachable, and the transaction fails too) is asked again at the next
// transaction; the transaction begins meanwhile as on plain Postgres.
func (c *engine) txOptions(ctx context.Context, commitQuery string) pgx.TxOptions {
	opts := pgx.TxOptions{IsoLevel: c.cfg.IsoLevel, CommitQuery: commitQuery}
	if c.onCitus(ctx) {
		opts.BeginQuery = citusmode.Begin(opts.IsoLevel)
		if commitQuery == groupCommitSQL {
			opts.CommitQuery = groupCommitCitusSQL
		}
	}
	return opts
}

// onCitus reports whether the consumer's schema is distributed by Citus
// (citusmode), asking the database the first time; false when it cannot ask.
func (c *engine) onCitus(ctx context.Context) bool {
	if on, known := c.citus.Known(); known {
		return on
	}
	q, ok := c.cfg.Pool.(citusmode.Querier) // *pgxpool.Pool and *pgx.Conn are
	if !ok {
		q = beginnerQuerier{c.cfg.Pool}
	}
	on, err := c.citus.On(ctx, q, pgx.Identifier{c.cfg.Schema, "inbox"}.Sanitize())
	return err == nil && on
}

// beginnerQuerier runs each query of citusmode's question in a transaction of its
// own, for a Config.Pool that can only begin transactions.
type beginnerQuerier struct{ db txmark.Beginner }

func (b beginnerQuerier) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return citusmode.RowIn(ctx, b.db, sql, args...)
}

// txState reports whether tx is still open and usable, from the status of the last
// ReadyForQuery: nil while in a transaction, ErrTxEnded when idle (the handler ended
// it), ErrTxAborted when a statement failed. A closed connection reports nil: the
// next statement fails with the real error.
func txState(tx pgx.Tx) error {
	pc := tx.Conn().PgConn()
	if pc.IsClosed() {
		return nil
	}
	switch pc.TxStatus() {
	case 'T':
		return nil
	case 'E':
		return ErrTxAborted
	default:
		return fmt.Errorf("%w (no transaction was open when the handler returned)", ErrTxEnded)
	}
}

// commit commits tx, the transaction of one message or one batch, only if it is still
// the transaction idem began, and never after ctx was cancelled. Once COMMIT is sent it
// runs under a context the message's cancellation cannot cut, bounded by
// CommitTimeout, because a COMMIT cut in flight has an unknown outcome. The errors:
// ErrTxEnded or ErrTxAborted (nothing committed by idem), ErrCanceled (nothing
// committed), ErrCommitUnknown (COMMIT was sent and failed: it may have happened).
func (c *engine) commit(ctx context.Context, tx pgx.Tx) error {
	if err := txState(tx); err != nil {
		return err
	}
	if ctx.Err() != nil {
		// pgx would refuse to send COMMIT on a cancelled context; say what happened.
		return fmt.Errorf("%w (%v)", ErrCanceled, context.Cause(ctx))
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.CommitTimeout)
	defer cancel()
	err := tx.Commit(cctx)
	switch {
	case err == nil:
		return nil
	case txmark.Missing(err):
		return errTxReplaced
	default:
		return fmt.Errorf("%w: %v", ErrCommitUnknown, err)
	}
}

// errTxReplaced: the handler ended idem's transaction and began another; idem found
// out from its mark or its savepoint, and rolls the handler's one back.
var errTxReplaced = fmt.Errorf("%w (a transaction the handler began was open in its place; it is rolled back)", ErrTxEnded)

// savepointGone reports whether err says a savepoint idem made, or the transaction
// it was made in, no longer exists.
func savepointGone(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) &&
		(pgErr.Code == pgerrcode.InvalidSavepointSpecification || pgErr.Code == pgerrcode.NoActiveSQLTransaction)
}

type txKey struct{}

// ownedTx is the transaction a handler sees. idem owns it: Commit and Rollback are
// refused, because in group-commit mode the handler's work is part of a transaction
// shared with other messages, and in every mode the commit must cover the inbox row
// too. Return an error instead to roll back. Raw SQL that ends the
// transaction (Exec "COMMIT" or "ROLLBACK") cannot be refused; idem detects it
// and records the key as failed with ErrTxEnded (see tx.go).
type ownedTx struct{ pgx.Tx }

func (ownedTx) Commit(context.Context) error   { return ErrTxOwned }
func (ownedTx) Rollback(context.Context) error { return ErrTxOwned }

// Tx returns the transaction the consumer opened for the message being handled.
// Business writes and effects.Enqueue go through it. In group-commit mode (and in a
// BatchHandler) it is shared with the other messages of a batch: do not assume it
// is the whole transaction. Never end it yourself, with its methods or with raw SQL
// (COMMIT, ROLLBACK): return nil to commit and an error to roll back. A handler
// that ends it has its key recorded as failed (ErrTxEnded).
//
// Outside idem's middleware there is no transaction, and Tx panics with ErrNoTx,
// whose text says what to fix: the consumer's Middleware is not around this
// handler, or a middleware that calls Tx is outside idem's, or ctx is not the
// message's context. TxSafely returns the error instead.
func Tx(ctx context.Context) pgx.Tx {
	tx, err := TxSafely(ctx)
	if err != nil {
		panic(err)
	}
	return tx
}

// TxSafely is Tx, returning ErrNoTx (code "no_transaction") instead of panicking
// when ctx carries no idem transaction.
func TxSafely(ctx context.Context) (pgx.Tx, error) {
	if tx, _ := ctx.Value(txKey{}).(pgx.Tx); tx != nil {
		return tx, nil
	}
	return nil, ErrNoTx
}
