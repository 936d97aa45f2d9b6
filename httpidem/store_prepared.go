package httpidem

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/txmark"
)

// preparedStmts are the statements of a transactional request's two round trips
// (BEGIN with the claim, the stored answer with COMMIT), each prepared under a
// name of its own on every connection that runs it, and sent with pgconn's batch
// rather than pgx's: pgx's pipeline bookkeeping, argument encoding and result
// scanning cost a request more Go CPU and allocations than the statements' own
// messages. The wire is the same as pgx's default query mode sends (prepared
// statements, Bind and Execute, one Sync), and so is every outcome.
//
// They are used only when the pool's connections prepare statements anyway
// (pgx.QueryExecModeCacheStatement, the default) and have no pgx tracer, which
// would not see statements sent below pgx; otherwise the claim and the answer go
// through pgx as before (ClaimResponseTx, SaveResponseCommit).
type preparedStmts struct {
	begin, claim, save, commit preparedStmt
}

// preparedStmt is a statement and its name, sha256 of its text: one name per text,
// so that middlewares on two schemas sharing a pool never clash.
type preparedStmt struct{ name, sql string }

func newPreparedStmt(sql string) preparedStmt {
	sum := sha256.Sum256([]byte(sql))
	return preparedStmt{name: "idem_" + hex.EncodeToString(sum[:12]), sql: sql}
}

func newPreparedStmts(s *responseStore) *preparedStmts {
	return &preparedStmts{
		begin:  newPreparedStmt(beginSQL),
		claim:  newPreparedStmt(s.q.ClaimMarkedReturningRow),
		save:   newPreparedStmt(s.q.SaveResponseOrFail),
		commit: newPreparedStmt("commit"),
	}
}

// usePrepared reports whether a pool whose connections have cfg runs the
// prepared statements.
func usePrepared(cfg *pgx.ConnConfig) bool {
	return cfg.DefaultQueryExecMode == pgx.QueryExecModeCacheStatement && cfg.Tracer == nil
}

// described are the statements as prepared on one connection.
type described struct {
	begin, claim, save, commit *pgconn.StatementDescription
}

// prepare prepares the statements on conn, outside any transaction. pgx's Prepare
// remembers each by name on the connection: after the first request on a
// connection it is a map lookup, with no round trip.
func (p *preparedStmts) prepare(ctx context.Context, conn *pgx.Conn) (described, error) {
	var d described
	for _, it := range [...]struct {
		into **pgconn.StatementDescription
		stmt preparedStmt
	}{{&d.begin, p.begin}, {&d.claim, p.claim}, {&d.save, p.save}, {&d.commit, p.commit}} {
		sd, err := conn.Prepare(ctx, it.stmt.name, it.stmt.sql)
		if err != nil {
			return described{}, err
		}
		*it.into = sd
	}
	return d, nil
}

// Parameter and result formats: text for text, binary for the rest.
var (
	claimParamFormats = []int16{0, 0, 0, 1, 1, 0}       // consumer, tenant, key, fingerprint, retention, lock_timeout
	saveParamFormats  = []int16{0, 0, 0, 1, 1, 1, 1, 0} // consumer, tenant, key, ctid, status, headers, body, ref
	binaryResult      = []int16{1}
)

// params lays a statement's parameters out in one buffer: each value a slice of
// it, nil for NULL. Up to maxParams; the buffer is sized up front (newParams).
type params struct {
	buf    []byte
	n      int
	bounds [maxParams][2]int // start and end in buf; start -1 for NULL
	out    [maxParams][]byte
}

const maxParams = 8

// newParams returns params whose buffer holds size bytes before it grows.
func newParams(size int) *params { return &params{buf: make([]byte, 0, size)} }

func (p *params) next(start int) { p.bounds[p.n] = [2]int{start, len(p.buf)}; p.n++ }
func (p *params) text(s string) {
	start := len(p.buf)
	p.buf = append(p.buf, s...)
	p.next(start)
}
func (p *params) bytes(b []byte) {
	if b == nil {
		p.null()
		return
	}
	start := len(p.buf)
	p.buf = append(p.buf, b...)
	p.next(start)
}
func (p *params) null() { p.next(-1) }
func (p *params) int16(v int) {
	start := len(p.buf)
	p.buf = binary.BigEndian.AppendUint16(p.buf, uint16(v))
	p.next(start)
}

// interval appends d in Postgres's binary interval form: microseconds, days,
// months.
func (p *params) interval(d time.Duration) {
	start := len(p.buf)
	p.buf = binary.BigEndian.AppendUint64(p.buf, uint64(d.Microseconds()))
	p.buf = binary.BigEndian.AppendUint64(p.buf, 0)
	p.next(start)
}

// tid appends a row's ctid in its binary form: block, offset.
func (p *params) tid(r rowRef) {
	start := len(p.buf)
	p.buf = binary.BigEndian.AppendUint32(p.buf, r.tid.BlockNumber)
	p.buf = binary.BigEndian.AppendUint16(p.buf, r.tid.OffsetNumber)
	p.next(start)
}

// values are the parameters, slices of the buffer.
func (p *params) values() [][]byte {
	for i, b := range p.bounds[:p.n] {
		p.out[i] = nil
		if b[0] >= 0 {
			p.out[i] = p.buf[b[0]:b[1]:b[1]]
		}
	}
	return p.out[:p.n]
}

// runBatch sends b on pc and reads its results in order, calling row for each row
// of the i-th statement. It returns how many statements completed, the command
// tag of the last one that did, and the first error.
func runBatch(ctx context.Context, pc *pgconn.PgConn, b *pgconn.Batch, row func(i int, values [][]byte)) (int, pgconn.CommandTag, error) {
	mrr := pc.ExecBatch(ctx, b)
	done := 0
	var tag pgconn.CommandTag
	for mrr.NextResult() {
		rr := mrr.ResultReader()
		for rr.NextRow() {
			if row != nil {
				row(done, rr.Values())
			}
		}
		t, err := rr.Close()
		if err != nil {
			_ = mrr.Close()
			return done, tag, err
		}
		tag = t
		done++
	}
	return done, tag, mrr.Close()
}

// claimPrepared sends BEGIN and c's claim, which also sets the transaction's mark
// and lock_timeout, in one round trip on conn (outside any transaction), as
// ClaimResponseTx's first round trip does, and fills row with the claimed row's
// ctid. A key that has
// a row already is pgx.ErrNoRows, for insertOrResponse.
func (s *responseStore) claimPrepared(ctx context.Context, conn *pgx.Conn, d described, c inboxdb.Claim, wait time.Duration, row *rowRef) error {
	p := newParams(40 + len(c.Consumer) + len(c.Tenant) + len(c.Key) + len(c.Fingerprint))
	p.text(c.Consumer)
	p.text(c.Tenant)
	p.text(c.Key)
	p.bytes(c.Fingerprint)
	p.interval(retentionOf(c.Retention))
	p.text(formatMillis(wait))
	var b pgconn.Batch
	b.ExecStatement(d.begin, nil, nil, nil)
	b.ExecStatement(d.claim, p.values(), claimParamFormats, binaryResult)
	claimed := false
	var bad error
	_, _, err := runBatch(ctx, conn.PgConn(), &b, func(i int, v [][]byte) {
		if i != 1 {
			return
		}
		if len(v) != 1 || len(v[0]) != 6 {
			bad = fmt.Errorf("idem: the claim returned %d values, not a ctid", len(v))
			return
		}
		row.tid.BlockNumber = binary.BigEndian.Uint32(v[0])
		row.tid.OffsetNumber = binary.BigEndian.Uint16(v[0][4:])
		row.tid.Valid = true
		claimed = true
	})
	switch {
	case err != nil:
		return err
	case bad != nil:
		return bad
	case !claimed:
		return pgx.ErrNoRows
	}
	return nil
}

// saveCommitPrepared is SaveResponseCommit through the prepared statements: the
// answer's guarded UPDATE and COMMIT in one round trip, with the same outcomes.
func (s *responseStore) saveCommitPrepared(ctx context.Context, conn *pgx.Conn, d described, id inboxdb.ID, row rowRef, resp *storedResponse) error {
	if err := validateStored(resp); err != nil {
		return err
	}
	header := resp.encodedHeader()
	p := newParams(16 + len(id.Consumer) + len(id.Tenant) + len(id.Key) + len(resp.Body) + len(resp.BodyRef) + len(header))
	p.text(id.Consumer)
	p.text(id.Tenant)
	p.text(id.Key)
	p.tid(row)
	p.int16(resp.Status)
	p.bytes(header)
	if resp.BodyRef != "" {
		p.null()
		p.text(resp.BodyRef)
	} else {
		p.bytes(nonNilBody(resp.Body))
		p.null()
	}
	var b pgconn.Batch
	b.ExecStatement(d.save, p.values(), saveParamFormats, nil)
	b.ExecStatement(d.commit, nil, nil, nil)
	done, tag, err := runBatch(ctx, conn.PgConn(), &b, nil)
	switch {
	case done == 0 && err != nil:
		var pgErr *pgconn.PgError
		switch {
		case txmark.Missing(err):
			return txmark.ErrTxReplaced
		case errors.As(err, &pgErr) && pgErr.Code == "22012":
			return fmt.Errorf("idem: no completed inbox row for consumer %q key %q to store the response on", id.Consumer, id.Key)
		}
		return s.wrap(err)
	case err != nil:
		return fmt.Errorf("%w: %v", txmark.ErrCommitUnknown, err)
	case tag.String() != "COMMIT":
		return fmt.Errorf("idem: COMMIT answered %q: the transaction had failed and nothing committed", tag.String())
	}
	return nil
}
