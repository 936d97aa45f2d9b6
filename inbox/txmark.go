package inbox

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
)

// A handler holds the transaction idem began and can end it with raw SQL
// (tx.Exec(ctx, "COMMIT; BEGIN"), "ROLLBACK; BEGIN"), leaving the connection in a
// transaction of its own. The connection's status is then 'T' as before, and a
// COMMIT sent afterwards would commit the handler's transaction instead of idem's.
// So idem marks its transaction with a transaction-local setting, which ends with
// the transaction however it ends, and checks the mark in the round trip of its
// COMMIT or ROLLBACK: a missing mark stops the COMMIT (the check fails, and the
// COMMIT pipelined behind a failed statement is never executed). Package consumer
// does the same with its own copy (consumer/tx.go), under the same setting name.

// TxMark marks the transaction it runs in as the one idem began. Send it in the
// transaction's first round trip, after BEGIN (ClaimResponseTx sets the same mark
// itself). SaveResponseCommit, CompleteLeaseResponseCommit and CommitMarked refuse
// to commit a transaction without it (ErrTxReplaced); RollbackMarked reports
// whether it was there.
const TxMark = "SET LOCAL idem.tx = 'on'"

const (
	txMarkMissing = "idem: the transaction idem began has ended"
	// The CASE is not constant (current_setting is stable), so the cast runs, and
	// fails, only when the mark is missing.
	// txMarked is true in a transaction that carries the mark.
	txMarked    = "coalesce(current_setting('idem.tx', true), '') = 'on'"
	txMarkCheck = "SELECT (CASE WHEN " + txMarked + " THEN '0' ELSE '" + txMarkMissing + "' END)::int"
)

// ErrTxReplaced: the transaction idem began (marked with TxMark) had ended by the
// time idem meant to commit it, and another transaction was open in its place: the
// handler ran a raw COMMIT or ROLLBACK and then BEGIN. Nothing was committed by the
// call that returns it; roll the open transaction back.
var ErrTxReplaced = newError("tx_replaced", "the transaction idem began was ended by raw SQL and another was open in its place; nothing was committed", false)

// txMarkGone reports whether err is txMarkCheck failing.
func txMarkGone(err error) bool {
	var pgErr interface {
		SQLState() string
		error
	}
	return errors.As(err, &pgErr) && pgErr.SQLState() == "22P02" && strings.Contains(pgErr.Error(), txMarkMissing)
}

// CommitMarked commits conn's transaction in one round trip, if it carries TxMark.
// Otherwise it commits nothing, returns ErrTxReplaced, and leaves the transaction
// failed for the caller to roll back. A failed COMMIT returns ErrCommitUnknown.
func CommitMarked(ctx context.Context, conn BatchSender) error {
	b := &pgx.Batch{}
	b.Queue(txMarkCheck)
	b.Queue("commit")
	br := conn.SendBatch(ctx, b)
	var zero int
	if err := br.QueryRow().Scan(&zero); err != nil {
		_ = br.Close()
		if txMarkGone(err) {
			return ErrTxReplaced
		}
		return err
	}
	return commitResult(br)
}

// commitResult reads the COMMIT at the end of a batch and closes it.
func commitResult(br pgx.BatchResults) error {
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

// RollbackMarked rolls back conn's open transaction and reports, from the same
// round trip, whether it was the one idem began (it carried TxMark). Call it only
// while conn is in an open transaction (status 'T'): a failed one cannot be asked.
func RollbackMarked(ctx context.Context, conn BatchSender) (marked bool, err error) {
	b := &pgx.Batch{}
	b.Queue("SELECT " + txMarked)
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
