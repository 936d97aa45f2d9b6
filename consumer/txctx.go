package consumer

import (
	"context"

	"github.com/jackc/pgx/v5"
)

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
