// Package txmark tells idem's own transaction from one a handler opened in its
// place.
//
// A handler holds the transaction idem began and can end it with raw SQL
// (tx.Exec(ctx, "COMMIT"), "ROLLBACK", even "COMMIT; BEGIN"), leaving the connection
// in a transaction of its own. The connection's status is then 'T' as before, and a
// COMMIT sent afterwards would commit the handler's transaction instead of idem's.
// So idem marks its transaction with a transaction-local setting (Mark), which ends
// with the transaction however it ends, and checks the mark (Check) in the round
// trip of its COMMIT: a missing mark fails the check, and a COMMIT pipelined behind
// a failed statement, or sent in the same simple query, is never executed.
//
// The consumer and httpidem both use it. It imports nothing of idem but its error
// type.
package txmark

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/errcode"
)

// Beginner starts a transaction; *pgxpool.Pool and *pgx.Conn do. BeginTx must
// honour pgx.TxOptions.CommitQuery, as pgx's own implementations do: idem marks
// every transaction it begins and checks the mark in its COMMIT, to know that the
// transaction it commits is still its own.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
}

// Mark marks the transaction it runs in as the one idem began. Send it in the
// transaction's first round trip, after BEGIN.
const Mark = "SET LOCAL idem.tx = 'on'"

// Marked is an SQL expression, true in a transaction that carries the mark (and
// false, never NULL, in one without). It is written without coalesce: Citus
// refuses a function that is not IMMUTABLE inside COALESCE or CASE in a statement
// that writes a distributed table, and Marked is in such statements' WHERE.
const Marked = "current_setting('idem.tx', true) IS NOT DISTINCT FROM 'on'"

// missing is the text of Check's error, which Missing looks for.
const missing = "idem: the transaction idem began has ended"

// Check is a statement that fails (SQLSTATE 22P02, with a text Missing recognises)
// in a transaction without the mark.
const Check = "SELECT " + Guard + "'0'" + GuardEnd

// Guard and GuardEnd wrap an SQL expression of type text that holds an integer:
// Guard + expr + GuardEnd is that integer in a transaction with the mark, and fails
// as Check does without it. The CASE is not constant (current_setting is stable),
// so the cast runs, and fails, only when the mark is missing, never at plan time.
const (
	Guard    = "(CASE WHEN " + Marked + " THEN "
	GuardEnd = " ELSE '" + missing + "' END)::int"
)

var (
	// ErrTxReplaced is returned when the transaction idem began (marked with Mark)
	// had ended by the time idem meant to commit it, and another transaction was
	// open in its place: the handler ran a raw COMMIT or ROLLBACK and then BEGIN.
	// Nothing was committed by the call that returns it; roll the open transaction
	// back.
	ErrTxReplaced = errcode.Transient("tx_replaced", "the transaction idem began was ended by raw SQL and another was open in its place; nothing was committed")
	// ErrCommitUnknown is returned when COMMIT was sent and failed, so whether the
	// transaction committed is unknown (a connection cut mid-commit). The key
	// settles it: a retry finds the row, or runs again.
	ErrCommitUnknown = errcode.Transient("commit_unknown", "COMMIT failed; whether the transaction committed is unknown")
)

// Missing reports whether err is Check failing: the mark was gone.
func Missing(err error) bool {
	var pgErr interface {
		SQLState() string
		error
	}
	return errors.As(err, &pgErr) && pgErr.SQLState() == "22P02" && strings.Contains(pgErr.Error(), missing)
}

// BatchSender pipelines statements; pgx.Tx and *pgx.Conn do.
type BatchSender interface {
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// Commit commits conn's transaction in one round trip, if it carries the mark.
// Otherwise it commits nothing, returns ErrTxReplaced, and leaves the transaction
// failed for the caller to roll back. A failed COMMIT returns ErrCommitUnknown.
func Commit(ctx context.Context, conn BatchSender) error {
	b := &pgx.Batch{}
	b.Queue(Check)
	b.Queue("commit")
	br := conn.SendBatch(ctx, b)
	var zero int
	if err := br.QueryRow().Scan(&zero); err != nil {
		_ = br.Close()
		if Missing(err) {
			return ErrTxReplaced
		}
		return err
	}
	return CommitResult(br)
}

// CommitResult reads the COMMIT at the end of a batch and closes the batch. A
// failed COMMIT is ErrCommitUnknown; a COMMIT that answers ROLLBACK (the
// transaction had failed) is an error that says nothing committed.
func CommitResult(br pgx.BatchResults) error {
	tag, err := br.Exec()
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("%w: %v", ErrCommitUnknown, err)
	}
	if tag.String() != "COMMIT" {
		return fmt.Errorf("idem: COMMIT answered %q: the transaction had failed and nothing committed", tag.String())
	}
	return nil
}

// Rollback rolls back conn's open transaction and reports, from the same round
// trip, whether it was the one idem began (it carried the mark). Call it only while
// conn is in an open transaction (status 'T'): a failed one cannot be asked.
func Rollback(ctx context.Context, conn BatchSender) (marked bool, err error) {
	b := &pgx.Batch{}
	b.Queue("SELECT " + Marked)
	b.Queue("rollback")
	br := conn.SendBatch(ctx, b)
	if err := br.QueryRow().Scan(&marked); err != nil {
		_ = br.Close()
		return false, err
	}
	_, err = br.Exec()
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return marked, err
}
