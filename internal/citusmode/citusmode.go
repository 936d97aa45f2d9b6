// Package citusmode tells whether idem's tables in a schema are distributed by
// Citus, and holds what idem sends differently then.
//
// The rule: idem runs in Citus mode on a schema whose inbox table is a Citus
// distributed table (the citus extension is installed and pg_dist_partition lists
// the table), as `idem migrate up --citus` leaves it. Nothing else switches it:
// there is no knob on the consumer's, httpidem's or the janitor's config. Each of
// them asks once, on its first transaction, and keeps the answer (Detector).
//
// It imports nothing of idem.
package citusmode

import (
	"context"
	"sync"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
)

// PropagateSet makes the SET LOCAL statements that follow it in the transaction
// reach the Citus workers too (lock_timeout, idem's marks): Citus applies them on
// the coordinator only by default. It is the first statement of a transaction in
// Citus mode, sent in the round trip of the transaction's other settings.
const PropagateSet = "SET LOCAL citus.propagate_set_commands = 'local'"

// StopPropagating ends PropagateSet for the SET LOCAL statements that follow it,
// for a setting that only the coordinator reads.
const StopPropagating = "SET LOCAL citus.propagate_set_commands = 'none'"

// hasCitusSQL answers whether Citus's catalog is there (the citus extension is
// installed), and so whether distributedSQL can run: one statement, and the only
// one, on a plain Postgres.
const hasCitusSQL = `SELECT to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL`

// distributedSQL answers whether the table $1 (a qualified name) is a Citus
// distributed or reference table.
const distributedSQL = `SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_dist_partition WHERE logicalrelid = to_regclass($1))`

// Querier runs one query; *pgxpool.Pool, *pgx.Conn and pgx.Tx all do.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Installed reports whether the citus extension is installed in the database.
func Installed(ctx context.Context, q Querier) (bool, error) {
	var on bool
	err := q.QueryRow(ctx, hasCitusSQL).Scan(&on)
	return on, err
}

// Distributed reports whether table (a qualified, quoted name such as
// "idem".inbox) is distributed by Citus.
func Distributed(ctx context.Context, q Querier, table string) (bool, error) {
	on, err := Installed(ctx, q)
	if err != nil || !on {
		return false, err
	}
	err = q.QueryRow(ctx, distributedSQL, table).Scan(&on)
	return on, err
}

// Detector asks Distributed once and keeps the answer; an error is not kept, so
// the next call asks again. Its zero value is ready to use; it is safe for
// concurrent use. The kept answer is read without a lock (Known is on the
// consumer's and httpidem's path of every message and request); one question at
// a time is asked.
type Detector struct {
	mu    sync.Mutex    // held while asking
	state atomic.Uint32 // 0 unknown, then stateOff or stateOn
}

const (
	stateOff = 1
	stateOn  = 2
)

// Known returns the kept answer, if there is one (known).
func (d *Detector) Known() (on, known bool) {
	st := d.state.Load()
	return st == stateOn, st != 0
}

// On reports whether table is distributed, asking q the first time only.
func (d *Detector) On(ctx context.Context, q Querier, table string) (bool, error) {
	if on, known := d.Known(); known {
		return on, nil
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if on, known := d.Known(); known { // asked while this call waited
		return on, nil
	}
	on, err := Distributed(ctx, q, table)
	if err != nil {
		return false, err
	}
	st := uint32(stateOff)
	if on {
		st = stateOn
	}
	d.state.Store(st)
	return on, nil
}

// Begin is the BEGIN of a transaction in Citus mode (pgx's TxOptions.BeginQuery):
// BEGIN at iso (the server's default when empty), and PropagateSet in the same
// simple query, so that it costs no round trip.
func Begin(iso pgx.TxIsoLevel) string {
	begin := "BEGIN"
	if iso != "" {
		begin += " ISOLATION LEVEL " + string(iso)
	}
	return begin + "; " + PropagateSet
}

// Beginner begins transactions; *pgxpool.Pool and *pgx.Conn do.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// RowIn is QueryRow run in a transaction of its own on db, for a caller that can
// only begin transactions: the query runs when the row is scanned.
func RowIn(ctx context.Context, db Beginner, sql string, args ...any) pgx.Row {
	return rowIn{ctx: ctx, db: db, sql: sql, args: args}
}

type rowIn struct {
	ctx  context.Context
	db   Beginner
	sql  string
	args []any
}

func (r rowIn) Scan(dest ...any) error {
	return pgx.BeginFunc(r.ctx, r.db, func(tx pgx.Tx) error {
		return tx.QueryRow(r.ctx, r.sql, r.args...).Scan(dest...)
	})
}
