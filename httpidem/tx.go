package httpidem

import (
	"context"
	"errors"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/txmark"
)

// connTx is a transaction on one connection of the pool, which idem begins and
// ends in the round trips of its own statements: BEGIN goes with the claim, and
// COMMIT with the stored response. pgx's Tx sends BEGIN and COMMIT each on a
// round trip of its own, which made a request cost two more round trips than a
// bare handler's. The handler sees it as a pgx.Tx.
type connTx struct {
	pc   *pgxpool.Conn
	conn *pgx.Conn
	sp   int64 // savepoints made so far, for nested Begin
	// xid is the transaction's ID (pg_current_xact_id), taken at BEGIN in lease
	// mode, where the key's row is not in the transaction: if the handler ended the
	// transaction with raw SQL, its status (pg_xact_status) tells whether the
	// handler's work committed.
	xid string
	// ended: a COMMIT idem sent found the mark gone (txmark.ErrTxReplaced), so the
	// handler ended idem's transaction; the failed check left the connection's
	// transaction failed, where the mark can no longer be asked.
	ended bool
}

var _ pgx.Tx = (*connTx)(nil)

// beginSQL starts every transaction idem opens: READ COMMITTED, which the claim
// relies on to see a concurrent winner's row after waiting for it. Each is marked
// with txmark.Mark in the same round trip.
const beginSQL = "begin isolation level read committed"

// settleTimeout bounds the statements that settle a request after its handler's
// transaction ended without idem's commit (finding out whether the handler
// committed itself, giving a lease back): they run whatever the request's context
// says, since the client leaving must not leave a lease held, but not forever.
const settleTimeout = 10 * time.Second

// The transaction ID of a lease-mode handler's transaction, and later its outcome.
const (
	xidSQL       = "SELECT pg_current_xact_id()::text"
	xidStatusSQL = "SELECT pg_xact_status($1::xid8)"
)

func acquireTx(ctx context.Context, pool *pgxpool.Pool) (*connTx, error) {
	pc, err := pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	return &connTx{pc: pc, conn: pc.Conn()}, nil
}

// inTx reports whether the connection is in a transaction (open or failed).
func (t *connTx) inTx() bool { return t.conn.PgConn().TxStatus() != 'I' }

// release rolls back whatever is still open and gives the connection back. A
// rollback that fails closes the connection, so it can never go back to the pool
// inside a transaction.
func (t *connTx) release(ctx context.Context) {
	if t.pc == nil {
		return
	}
	if !t.conn.IsClosed() && t.inTx() {
		if _, err := t.conn.Exec(context.WithoutCancel(ctx), "rollback"); err != nil {
			_ = t.conn.Close(context.WithoutCancel(ctx))
		}
	}
	t.pc.Release()
	t.pc = nil
}

// Begin starts a savepoint, as pgx's nested transactions do.
func (t *connTx) Begin(ctx context.Context) (pgx.Tx, error) {
	t.sp++
	name := "sp_" + strconv.FormatInt(t.sp, 10)
	if _, err := t.conn.Exec(ctx, "savepoint "+name); err != nil {
		return nil, err
	}
	return &savepointTx{parent: t, name: name}, nil
}

// Commit commits, if the transaction is still the one idem began (it carries
// txmark.Mark): a replacement the handler began is refused with
// txmark.ErrTxReplaced, and left failed for release to roll back. An error from
// COMMIT closes the connection, since the outcome is unknown.
func (t *connTx) Commit(ctx context.Context) error {
	err := t.noteEnded(txmark.Commit(ctx, t.conn))
	if errors.Is(err, txmark.ErrCommitUnknown) && !t.conn.IsClosed() && t.inTx() {
		_ = t.conn.Close(ctx)
	}
	return err
}

// txEnd is what rollbackMarked found of the transaction idem began.
type txEnd int

const (
	// txOpen: it was still the open transaction (in a transaction, carrying
	// txmark.Mark), and is now rolled back: nothing of the request committed.
	txOpen txEnd = iota
	// txFailed: a statement failed in the open transaction (status 'E'), or the
	// connection is gone. Postgres rolls such a transaction back; it cannot be asked
	// for the mark, so whether the handler ended idem's transaction before the
	// failure is unknown, and only the database can tell whether work committed.
	txFailed
	// txEnded: the handler ended it itself with raw SQL (a COMMIT or a ROLLBACK):
	// no transaction was open (status 'I'), or the open one lacked the mark (it
	// began another), or COMMIT found the mark gone (ended). What the handler wrote
	// after that ran outside idem's transaction.
	txEnded
)

// noteEnded records, from the error of a COMMIT idem sent, whether the handler
// had ended idem's transaction (txmark.ErrTxReplaced), and returns err.
func (t *connTx) noteEnded(err error) error {
	if errors.Is(err, txmark.ErrTxReplaced) {
		t.ended = true
	}
	return err
}

// rollbackMarked rolls back whatever is open and reports how the transaction idem
// began ended. A rollback that fails closes the connection.
func (t *connTx) rollbackMarked(ctx context.Context) txEnd {
	ctx = context.WithoutCancel(ctx)
	end := txFailed
	if t.ended {
		end = txEnded
	}
	if t.pc == nil || t.conn.IsClosed() {
		return end
	}
	switch t.conn.PgConn().TxStatus() {
	case 'I':
		return txEnded
	case 'T':
		if !t.ended {
			marked, err := txmark.Rollback(ctx, t.conn)
			switch {
			case err == nil && marked:
				return txOpen
			case err == nil:
				return txEnded
			}
		}
	}
	if t.inTx() {
		if _, err := t.conn.Exec(ctx, "rollback"); err != nil {
			_ = t.conn.Close(ctx)
		}
	}
	return end
}

// Rollback rolls back.
func (t *connTx) Rollback(ctx context.Context) error {
	if !t.inTx() {
		return pgx.ErrTxClosed
	}
	_, err := t.conn.Exec(ctx, "rollback")
	return err
}

func (t *connTx) CopyFrom(ctx context.Context, table pgx.Identifier, cols []string, src pgx.CopyFromSource) (int64, error) {
	return t.conn.CopyFrom(ctx, table, cols, src)
}

func (t *connTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	return t.conn.SendBatch(ctx, b)
}

// LargeObjects needs a pgx transaction value, which only pgx can make: Begin on a
// connection already in a transaction only draws a warning from Postgres, so it
// gives one without ending anything. Its Commit and Rollback must not be used.
func (t *connTx) LargeObjects() pgx.LargeObjects {
	inner, err := t.conn.Begin(context.Background())
	if err != nil {
		return pgx.LargeObjects{}
	}
	return inner.LargeObjects()
}

func (t *connTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	return t.conn.Prepare(ctx, name, sql)
}

func (t *connTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return t.conn.Exec(ctx, sql, args...)
}

func (t *connTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return t.conn.Query(ctx, sql, args...)
}

func (t *connTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return t.conn.QueryRow(ctx, sql, args...)
}

func (t *connTx) Conn() *pgx.Conn { return t.conn }

// savepointTx is a nested transaction: a savepoint of its parent.
type savepointTx struct {
	parent *connTx
	name   string
	closed bool
}

func (s *savepointTx) Begin(ctx context.Context) (pgx.Tx, error) { return s.parent.Begin(ctx) }

func (s *savepointTx) Commit(ctx context.Context) error {
	if s.closed {
		return pgx.ErrTxClosed
	}
	s.closed = true
	_, err := s.parent.conn.Exec(ctx, "release savepoint "+s.name)
	return err
}

func (s *savepointTx) Rollback(ctx context.Context) error {
	if s.closed {
		return pgx.ErrTxClosed
	}
	s.closed = true
	_, err := s.parent.conn.Exec(ctx, "rollback to savepoint "+s.name)
	return err
}

func (s *savepointTx) CopyFrom(ctx context.Context, table pgx.Identifier, cols []string, src pgx.CopyFromSource) (int64, error) {
	return s.parent.CopyFrom(ctx, table, cols, src)
}

func (s *savepointTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	return s.parent.SendBatch(ctx, b)
}

func (s *savepointTx) LargeObjects() pgx.LargeObjects { return s.parent.LargeObjects() }

func (s *savepointTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	return s.parent.Prepare(ctx, name, sql)
}

func (s *savepointTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return s.parent.Exec(ctx, sql, args...)
}

func (s *savepointTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return s.parent.Query(ctx, sql, args...)
}

func (s *savepointTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return s.parent.QueryRow(ctx, sql, args...)
}

func (s *savepointTx) Conn() *pgx.Conn { return s.parent.conn }
