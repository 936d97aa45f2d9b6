package httpidem

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"cmp"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/failgroup"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/txmark"
)

// storedResponse is an HTTP response stored on its key's inbox row (migration
// 003), so that a retry of the request gets it back.
type storedResponse struct {
	// Status is the status code.
	Status int
	// Header holds the stored headers under their canonical names (the same
	// underlying type as http.Header).
	Header map[string][]string
	// headerLines, when not nil, are the headers to store as the column holds
	// them (inboxdb.AppendHeader), in place of Header.
	headerLines []byte
	// Body is the body, nil when BodyRef is set.
	Body []byte
	// BodyRef, when not empty, stands for the body: the application stored a
	// reference instead of a body that holds personal data, and resolves it on a
	// replay.
	BodyRef string
}

// responseClaim is what a claim that knows about stored responses found.
type responseClaim struct {
	inboxdb.ClaimResult
	// Response is the existing row's stored response, if it has one.
	Response *storedResponse
	// ReplacedExpired: the key had a settled row past its expires_at; the claim
	// deleted it and claimed the key as new, since a key past its retention is
	// forgotten whether or not the janitor has come by yet.
	ReplacedExpired bool
	// Row locates the claimed row (ClaimResponseTx, when Claimed).
	Row rowRef
}

// responseStore is httpidem's one store: every statement a request sends to its
// key's inbox row, with the HTTP response that the row may hold (migration 003):
// stored in the transaction that claims the key, read back on a retry, and deleted
// by the janitor with the key.
type responseStore struct {
	schema string
	q      inboxdb.Queries
	// prepared, if set, are the statements of transactional mode's two round
	// trips, sent through pgconn (see preparedStmts): claimTx and saveCommit use
	// them.
	prepared *preparedStmts
}

// newResponseStore returns the store for schema.
func newResponseStore(schema string) (*responseStore, error) {
	schema = cmp.Or(schema, inbox.DefaultSchema)
	if err := pgschema.Validate(schema); err != nil {
		return nil, err
	}
	return &responseStore{schema: schema, q: inboxdb.New(schema)}, nil
}

// Schema is the schema the store's table lives in.
func (s *responseStore) Schema() string { return s.schema }

// wrap turns a missing table or column (migration 003 has not run) into
// inbox.ErrSchemaMissing.
func (s *responseStore) wrap(err error) error { return pgschema.Wrap(err, s.schema) }

// claimPrelude goes with a transactional claim in its round trip: BEGIN.
var claimPrelude = []string{beginSQL}

// claimTx begins a transaction on tx (outside any) and claims c in it, in one
// round trip, waiting up to wait for a concurrent claim of the key: through the
// prepared statements if the store has them (it returns them as prepared on the
// connection, for saveCommit), otherwise through pgx (ClaimResponseTx).
func (s *responseStore) claimTx(ctx context.Context, tx *connTx, c inboxdb.Claim, wait time.Duration) (responseClaim, described, error) {
	if s.prepared != nil {
		return s.ClaimResponsePrepared(ctx, tx.conn, s.prepared, c, wait)
	}
	res, err := s.ClaimResponseTx(ctx, tx, claimPrelude, c, wait)
	return res, described{}, err
}

// saveCommit stores resp on the row claimTx claimed (row) and commits, in one
// round trip, through the statements claimTx prepared (d) if it did.
func (s *responseStore) saveCommit(ctx context.Context, conn *pgx.Conn, d described, id inboxdb.ID, row rowRef, resp *storedResponse) error {
	if d.save != nil {
		return s.saveCommitPrepared(ctx, conn, d, id, row, resp)
	}
	return s.SaveResponseCommit(ctx, conn, id, row, resp)
}

// releaseLease gives a leased key back at once (lease_until = now()), if fence
// still holds it.
func (s *responseStore) releaseLease(ctx context.Context, db inboxdb.DBTX, id inboxdb.ID, fence int64) error {
	_, err := db.Exec(ctx, s.q.ReleaseLease, id.Consumer, id.Tenant, id.Key, fence)
	return s.wrap(err)
}

// retentionOf is a key's retention: d, or the inbox's default when d is 0.
func retentionOf(d time.Duration) time.Duration { return cmp.Or(d, inbox.DefaultRetention) }

// existing is what a claim that met rec says, for a claim of fingerprint fp.
func existing(rec *inboxdb.Record, fp []byte) inboxdb.ClaimResult {
	return inboxdb.ClaimResult{Existing: rec, Mismatch: !bytes.Equal(rec.Fingerprint, fp)}
}

// responseArgs are a response's column values, in column order.
func responseArgs(r *storedResponse) []any {
	if r == nil {
		return []any{nil, nil, nil, nil}
	}
	var ref *string
	if r.BodyRef != "" {
		ref = &r.BodyRef
	}
	var body []byte
	if ref == nil {
		body = nonNilBody(r.Body)
	}
	return []any{int16(r.Status), r.encodedHeader(), body, ref}
}

// encodedHeader is the response_headers column of r.
func (r *storedResponse) encodedHeader() []byte {
	if r.headerLines != nil {
		return r.headerLines
	}
	return inboxdb.EncodeHeader(r.Header)
}

// nonNilBody is body, or an empty body (as opposed to none stored) for nil.
func nonNilBody(body []byte) []byte {
	if body == nil {
		return []byte{}
	}
	return body
}

// validateStored checks what a stored response may hold.
func validateStored(r *storedResponse) error {
	if r.Status < 100 || r.Status > 599 {
		return fmt.Errorf("response status %d is outside 100..599", r.Status)
	}
	if r.BodyRef != "" {
		if err := inbox.ValidateKey(r.BodyRef); err != nil {
			return fmt.Errorf("response body reference: %w", err)
		}
	}
	return nil
}

// ClaimResponseTx is ClaimAfterTx for HTTP keys: in one round trip it sends the
// prelude statements (BEGIN) and claims c with the statement that also marks the
// transaction (txmark.Mark) and sets its lock_timeout to wait (the bound on
// waiting for a concurrent claim of the key; 0 is no bound). On a conflict it reads the existing row together with its stored
// response. A settled row past its expires_at is deleted in tx and the key claimed
// as new (ReplacedExpired). A claim returns Row, for SaveResponseCommit.
func (s *responseStore) ClaimResponseTx(ctx context.Context, tx interface {
	inboxdb.DBTX
	inboxdb.BatchSender
}, prelude []string, c inboxdb.Claim, wait time.Duration) (responseClaim, error) {
	return s.claimResponse(ctx, tx, prelude, c, s.q.ClaimMarkedReturningRow, formatMillis(wait))
}

// claimResponseRouted is ClaimResponseTx on Citus, whose prelude sets the
// lock_timeout and the mark itself (SET LOCAL, which Citus propagates to the
// worker): the claim is ClaimReturningRow, which Citus routes to the tenant's
// worker as it is. ClaimMarkedReturningRow is an INSERT … SELECT, which Citus
// runs through the coordinator and commits with two-phase commit.
func (s *responseStore) claimResponseRouted(ctx context.Context, tx interface {
	inboxdb.DBTX
	inboxdb.BatchSender
}, prelude []string, c inboxdb.Claim) (responseClaim, error) {
	return s.claimResponse(ctx, tx, prelude, c, s.q.ClaimReturningRow)
}

// claimResponse is ClaimResponseTx with first, the claim statement of the
// pipelined round trip, and its arguments after the claim's own.
func (s *responseStore) claimResponse(ctx context.Context, tx interface {
	inboxdb.DBTX
	inboxdb.BatchSender
}, prelude []string, c inboxdb.Claim, first string, more ...any) (responseClaim, error) {
	if err := c.Validate(); err != nil {
		return responseClaim{}, err
	}
	var row rowRef
	pipelined := false
	res, err := s.insertOrResponse(ctx, tx, c, func() (int64, error) {
		if pipelined {
			return 0, tx.QueryRow(ctx, s.q.ClaimReturningRow, c.Consumer, c.Tenant, c.Key, c.Fingerprint, retentionOf(c.Retention)).Scan(&row.tid)
		}
		pipelined = true
		b := &pgx.Batch{}
		for _, sql := range prelude {
			b.Queue(sql)
		}
		args := make([]any, 0, 5+len(more)) // one allocation, as a call's own variadic list
		args = append(args, c.Consumer, c.Tenant, c.Key, c.Fingerprint, retentionOf(c.Retention))
		b.Queue(first, append(args, more...)...)
		br := tx.SendBatch(ctx, b)
		for range prelude {
			if _, err := br.Exec(); err != nil {
				_ = br.Close()
				return 0, err
			}
		}
		err := br.QueryRow().Scan(&row.tid)
		if cerr := br.Close(); err == nil && cerr != nil {
			err = cerr
		}
		return 0, err
	})
	if res.Claimed {
		res.Row = row
	}
	return res, err
}

// ClaimResponsePrepared is ClaimResponseTx with BEGIN for its prelude, on conn
// outside any transaction, through the prepared statements p (see
// preparedStmts). It returns them as prepared on conn, for saveCommitPrepared.
func (s *responseStore) ClaimResponsePrepared(ctx context.Context, conn *pgx.Conn, p *preparedStmts, c inboxdb.Claim, wait time.Duration) (responseClaim, described, error) {
	if err := c.Validate(); err != nil {
		return responseClaim{}, described{}, err
	}
	d, err := p.prepare(ctx, conn)
	if err != nil {
		return responseClaim{}, described{}, s.wrap(err)
	}
	var row rowRef
	first := true
	res, err := s.insertOrResponse(ctx, conn, c, func() (int64, error) {
		if first {
			first = false
			return 0, s.claimPrepared(ctx, conn, d, c, wait, &row)
		}
		return 0, conn.QueryRow(ctx, s.q.ClaimReturningRow, c.Consumer, c.Tenant, c.Key, c.Fingerprint, retentionOf(c.Retention)).Scan(&row.tid)
	})
	if res.Claimed {
		res.Row = row
	}
	return res, d, err
}

// formatMillis is d in whole milliseconds, as lock_timeout takes it (0: no bound).
func formatMillis(d time.Duration) string { return strconv.FormatInt(max(d.Milliseconds(), 0), 10) }

// rowRef locates a row that ClaimResponseTx inserted, inside the transaction that
// inserted it: its ctid, which nothing but that transaction can change before it
// ends. SaveResponseCommit finds the row by it without an index lookup. The zero
// value locates nothing.
type rowRef struct{ tid pgtype.TID }

// LeaseResponse is Lease for HTTP keys: it commits a processing row with a lease
// at once (db outside a transaction), or takes over a processing row whose lease
// ran out (fence + 1, Attempts + 1). On a conflict it returns the existing row and
// its stored response; a settled row past its expires_at is deleted and the key
// leased as new.
func (s *responseStore) LeaseResponse(ctx context.Context, db inboxdb.DBTX, c inboxdb.Claim, lease time.Duration) (responseClaim, error) {
	if err := c.Validate(); err != nil {
		return responseClaim{}, err
	}
	return s.insertOrResponse(ctx, db, c, func() (int64, error) {
		var fence int64
		err := db.QueryRow(ctx, s.q.Lease, c.Consumer, c.Tenant, c.Key, c.Fingerprint, retentionOf(c.Retention), lease).Scan(&fence)
		return fence, err
	})
}

// insertOrResponse is insertOr that reads the existing row with its response, and
// replaces an expired settled row.
func (s *responseStore) insertOrResponse(ctx context.Context, db inboxdb.DBTX, c inboxdb.Claim, insert func() (int64, error)) (responseClaim, error) {
	var out responseClaim
	for {
		fence, err := insert()
		if err == nil {
			out.ClaimResult = inboxdb.ClaimResult{Claimed: true, Fence: fence}
			return out, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return out, s.wrap(err)
		}
		rec, resp, err := s.GetResponse(ctx, db, c.ID)
		if errors.Is(err, inbox.ErrNotFound) {
			continue // deleted in between (a janitor, a released lease): insert again
		}
		if err != nil {
			return out, err
		}
		if rec.Expired() {
			if _, err := db.Exec(ctx, s.q.DeleteExpiredKey, c.Consumer, c.Tenant, c.Key); err != nil {
				return out, s.wrap(err)
			}
			out.ReplacedExpired = true
			continue
		}
		out.ClaimResult = existing(rec, c.Fingerprint)
		out.Response = resp
		return out, nil
	}
}

// SaveResponseTx stores resp on id's row, in the transaction that claimed it with
// ClaimResponseTx and holds the handler's work, so the response commits with the
// work or not at all.
func (s *responseStore) SaveResponseTx(ctx context.Context, tx inboxdb.DBTX, id inboxdb.ID, resp *storedResponse) error {
	if err := validateStored(resp); err != nil {
		return err
	}
	args := append([]any{id.Consumer, id.Tenant, id.Key}, responseArgs(resp)...)
	tag, err := tx.Exec(ctx, s.q.SaveResponse, args...)
	if err != nil {
		return s.wrap(err)
	}
	if tag.RowsAffected() != 1 {
		return fmt.Errorf("idem: no completed inbox row for consumer %q key %q to store the response on (was it claimed in this transaction?)", id.Consumer, id.Key)
	}
	return nil
}

// SaveResponseCommit stores resp on id's row and commits, in one round trip. conn
// must be running the transaction that claimed id with ClaimResponseTx, whose Row
// is row, begun with plain SQL ("begin") rather than through pgx's Tx, which would
// not know that it ended. If the transaction is not that one any more
// (ErrTxReplaced: it lost ClaimResponseTx's mark) or no completed row takes the
// response, nothing commits: the COMMIT behind the failed statement is never
// executed and the transaction is left failed, for the caller to roll back. A
// failed COMMIT returns ErrCommitUnknown.
func (s *responseStore) SaveResponseCommit(ctx context.Context, conn inboxdb.BatchSender, id inboxdb.ID, row rowRef, resp *storedResponse) error {
	if err := validateStored(resp); err != nil {
		return err
	}
	args := append([]any{id.Consumer, id.Tenant, id.Key, row.tid}, responseArgs(resp)...)
	return s.commitAfter(ctx, conn, s.q.SaveResponseOrFail, args, func() error {
		return fmt.Errorf("idem: no completed inbox row for consumer %q key %q to store the response on", id.Consumer, id.Key)
	})
}

// CompleteLeaseResponseCommit is CompleteLeaseResponseTx and COMMIT in one round
// trip, in a transaction marked with TxMark; a fence that no longer matches returns
// inbox.ErrLeaseLost and a missing mark ErrTxReplaced, and neither commits anything.
func (s *responseStore) CompleteLeaseResponseCommit(ctx context.Context, conn inboxdb.BatchSender, id inboxdb.ID, fence int64, retention time.Duration, resp *storedResponse) error {
	if err := validateStored(resp); err != nil {
		return err
	}
	args := append([]any{id.Consumer, id.Tenant, id.Key, fence, retentionOf(retention)}, responseArgs(resp)...)
	return s.commitAfter(ctx, conn, s.q.CompleteLeaseResponseOrFail, args, func() error { return inbox.ErrLeaseLost })
}

// commitAfter sends an "OrFail" statement and COMMIT in one batch. A missing mark
// is ErrTxReplaced; a division by zero is noRow. Either way nothing commits: the
// COMMIT behind a failed statement is never executed.
func (s *responseStore) commitAfter(ctx context.Context, conn inboxdb.BatchSender, sql string, args []any, noRow func() error) error {
	b := &pgx.Batch{}
	b.Queue(sql, args...)
	b.Queue("commit")
	br := conn.SendBatch(ctx, b)
	var one int
	if err := br.QueryRow().Scan(&one); err != nil {
		_ = br.Close()
		var pgErr interface{ SQLState() string }
		switch {
		case txmark.Missing(err):
			return txmark.ErrTxReplaced
		case errors.As(err, &pgErr) && pgErr.SQLState() == "22012":
			return noRow()
		}
		return s.wrap(err)
	}
	return txmark.CommitResult(br)
}

// AnswerCommitted stores resp, with code and msg as the row's error, on c's key
// when the key was settled without its response: the request's handler ran its
// own COMMIT, which committed the claim and part of its work, so the response can
// no longer commit with them. With fence 0 the row is a ClaimResponseTx claim
// (completed, with c's fingerprint, no response yet); with a fence it is the
// processing row that LeaseResponse gave that fence, and it becomes completed. It
// reports whether it found such a row: false means the claim never committed (tx
// mode) or the lease was lost (lease mode). Run it outside the request's
// transaction, after that has ended.
func (s *responseStore) AnswerCommitted(ctx context.Context, db inboxdb.DBTX, c inboxdb.Claim, fence int64, code, msg string, resp *storedResponse) (bool, error) {
	if err := c.Validate(); err != nil {
		return false, err
	}
	if err := validateStored(resp); err != nil {
		return false, err
	}
	sql, args := s.q.AnswerCommittedResponse, []any{c.Consumer, c.Tenant, c.Key, c.Fingerprint, code, msg}
	if fence != 0 {
		sql, args = s.q.AnswerCommittedLeaseResponse, []any{c.Consumer, c.Tenant, c.Key, fence, retentionOf(c.Retention), code, msg}
	}
	tag, err := db.Exec(ctx, sql, append(args, responseArgs(resp)...)...)
	if err != nil {
		return false, s.wrap(err)
	}
	return tag.RowsAffected() == 1, nil
}

// FailResponseTx records c as failed with its response (a final client error),
// unless the key already has a row, whose outcome and response it then returns.
// Call it in a transaction of its own, after the handler's transaction rolled back.
func (s *responseStore) FailResponseTx(ctx context.Context, tx inboxdb.DBTX, c inboxdb.Claim, code, msg string, resp *storedResponse) (responseClaim, error) {
	if err := c.Validate(); err != nil {
		return responseClaim{}, err
	}
	if err := validateStored(resp); err != nil {
		return responseClaim{}, err
	}
	args := append([]any{c.Consumer, c.Tenant, c.Key, c.Fingerprint, retentionOf(c.Retention), code, msg}, responseArgs(resp)...)
	args = append(args, failgroup.Mask(msg))
	return s.insertOrResponse(ctx, tx, c, func() (int64, error) {
		var inserted bool
		return 0, tx.QueryRow(ctx, s.q.FailResponse, args...).Scan(&inserted)
	})
}

// CompleteLeaseResponseTx is CompleteLeaseTx that stores resp on the row too.
func (s *responseStore) CompleteLeaseResponseTx(ctx context.Context, tx inboxdb.DBTX, id inboxdb.ID, fence int64, retention time.Duration, resp *storedResponse) error {
	if err := validateStored(resp); err != nil {
		return err
	}
	args := append([]any{id.Consumer, id.Tenant, id.Key, fence, retentionOf(retention)}, responseArgs(resp)...)
	tag, err := tx.Exec(ctx, s.q.CompleteLeaseResponse, args...)
	if err != nil {
		return s.wrap(err)
	}
	if tag.RowsAffected() == 0 {
		return inbox.ErrLeaseLost
	}
	return nil
}

// FailLeaseResponse is FailLease that stores resp on the row too.
func (s *responseStore) FailLeaseResponse(ctx context.Context, db inboxdb.DBTX, id inboxdb.ID, fence int64, retention time.Duration, code, msg string, resp *storedResponse) error {
	if err := validateStored(resp); err != nil {
		return err
	}
	args := append([]any{id.Consumer, id.Tenant, id.Key, fence, retentionOf(retention), code, msg}, responseArgs(resp)...)
	args = append(args, failgroup.Mask(msg))
	tag, err := db.Exec(ctx, s.q.FailLeaseResponse, args...)
	if err != nil {
		return s.wrap(err)
	}
	if tag.RowsAffected() == 0 {
		return inbox.ErrLeaseLost
	}
	return nil
}

// GetResponse reads one inbox row and its stored response (nil when it has none),
// or returns inbox.ErrNotFound.
func (s *responseStore) GetResponse(ctx context.Context, db inboxdb.DBTX, id inboxdb.ID) (*inboxdb.Record, *storedResponse, error) {
	var r inboxdb.Record
	var code, msg, ref *string
	var status *int16
	var header, body []byte
	err := db.QueryRow(ctx, s.q.GetResponse, id.Consumer, id.Tenant, id.Key).Scan(
		&r.Consumer, &r.Tenant, &r.Key, &r.Fingerprint, &r.State, &code, &msg, &r.Attempts,
		&r.LeaseUntil, &r.Fence, &r.ReceivedAt, &r.CompletedAt, &r.ExpiresAt, &r.Now,
		&status, &header, &body, &ref)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil, inbox.ErrNotFound
	}
	if err != nil {
		return nil, nil, s.wrap(err)
	}
	if code != nil {
		r.ErrorCode = *code
	}
	if msg != nil {
		r.Error = *msg
	}
	if status == nil {
		return &r, nil, nil
	}
	resp := &storedResponse{Status: int(*status), Header: inboxdb.DecodeHeader(header), Body: body}
	if ref != nil {
		resp.BodyRef = *ref
	}
	return &r, resp, nil
}
