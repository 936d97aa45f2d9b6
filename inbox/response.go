package inbox

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// Response is an HTTP response stored on its key's inbox row (migration 003), so
// that a retry of the request gets it back. Package httpidem writes and reads it;
// message consumers never do.
type Response struct {
	// Status is the status code.
	Status int
	// Header holds the stored headers under their canonical names (the same
	// underlying type as http.Header).
	Header map[string][]string
	// Body is the body, nil when BodyRef is set.
	Body []byte
	// BodyRef, when not empty, stands for the body: the application stored a
	// reference instead of a body that holds personal data, and resolves it on a
	// replay.
	BodyRef string
}

// ResponseClaim is what a claim that knows about stored responses found.
type ResponseClaim struct {
	ClaimResult
	// Response is the existing row's stored response, if it has one.
	Response *Response
	// ReplacedExpired: the key had a settled row past its expires_at; the claim
	// deleted it and claimed the key as new, since a key past its retention is
	// forgotten whether or not the janitor has come by yet.
	ReplacedExpired bool
	// Row locates the claimed row (ClaimResponseTx, when Claimed).
	Row RowRef
}

// responseQueries are the statements about stored responses; they live here, next
// to the code that encodes them, rather than in queries.go.
type responseQueries struct {
	claim, markWait                                             string
	get, save, fail, completeLease, failLease, deleteExpiredKey string
	saveOrFail, completeLeaseOrFail                             string
	answerCommitted, answerCommittedLease                       string
}

func newResponseQueries(schema string) responseQueries {
	t := schema + ".inbox"
	return responseQueries{
		// The consumer's claim (queries.go), returning where the row went.
		claim: `INSERT INTO ` + t + ` (consumer, tenant, key, fingerprint, state, completed_at, expires_at)
			VALUES ($1, $2, $3, $4, 'completed', now(), now() + $5::interval)
			ON CONFLICT (consumer, tenant, key) DO NOTHING
			RETURNING ctid`,
		// TxMark and SET LOCAL lock_timeout, in one statement.
		markWait: `SELECT set_config('lock_timeout', $1, true), set_config('idem.tx', 'on', true)`,
		get: `SELECT consumer, tenant, key, fingerprint, state, error_code, error, attempts,
				lease_until, fence, received_at, completed_at, expires_at, now(),
				response_status, response_headers, response_body, response_ref
			FROM ` + t + ` WHERE consumer = $1 AND tenant = $2 AND key = $3`,
		save: `UPDATE ` + t + ` SET response_status = $4, response_headers = $5, response_body = $6, response_ref = $7
			WHERE consumer = $1 AND tenant = $2 AND key = $3 AND state = 'completed'`,
		fail: `INSERT INTO ` + t + ` (consumer, tenant, key, fingerprint, state, completed_at, expires_at, error_code, error,
				response_status, response_headers, response_body, response_ref)
			VALUES ($1, $2, $3, $4, 'failed', now(), now() + $5::interval, $6, $7, $8, $9, $10, $11)
			ON CONFLICT (consumer, tenant, key) DO NOTHING
			RETURNING true`,
		completeLease: `UPDATE ` + t + ` SET state = 'completed', completed_at = now(), lease_until = NULL,
				expires_at = now() + $5::interval,
				response_status = $6, response_headers = $7, response_body = $8, response_ref = $9
			WHERE consumer = $1 AND tenant = $2 AND key = $3 AND fence = $4 AND state = 'processing'`,
		failLease: `UPDATE ` + t + ` SET state = 'failed', completed_at = now(), lease_until = NULL,
				expires_at = now() + $5::interval, error_code = $6, error = $7,
				response_status = $8, response_headers = $9, response_body = $10, response_ref = $11
			WHERE consumer = $1 AND tenant = $2 AND key = $3 AND fence = $4 AND state = 'processing'`,
		// The "OrFail" forms go to the server in one round trip with COMMIT: an
		// update that matched no row, or a transaction without idem's mark (TxMark:
		// the handler ended idem's transaction and began another), must stop that
		// COMMIT, so they fail the statement, which leaves the transaction failed
		// and the COMMIT unexecuted: division by zero for no row, and for no mark
		// the cast of txMarkMissing to int (the CASE is not constant, so a cast
		// that fails is raised only when it is reached, never at plan time). An
		// update never runs in a transaction without the mark.
		saveOrFail: `WITH saved AS (UPDATE ` + t + ` SET response_status = $5, response_headers = $6, response_body = $7, response_ref = $8
				WHERE ctid = $4 AND consumer = $1 AND tenant = $2 AND key = $3 AND state = 'completed'
					AND ` + txMarked + ` RETURNING 1)
			SELECT (CASE WHEN ` + txMarked + ` THEN (1 / count(*))::text ELSE '` + txMarkMissing + `' END)::int FROM saved`,
		completeLeaseOrFail: `WITH saved AS (UPDATE ` + t + ` SET state = 'completed', completed_at = now(), lease_until = NULL,
				expires_at = now() + $5::interval,
				response_status = $6, response_headers = $7, response_body = $8, response_ref = $9
				WHERE consumer = $1 AND tenant = $2 AND key = $3 AND fence = $4 AND state = 'processing'
					AND ` + txMarked + ` RETURNING 1)
			SELECT (CASE WHEN ` + txMarked + ` THEN (1 / count(*))::text ELSE '` + txMarkMissing + `' END)::int FROM saved`,
		// A claim that committed without SaveResponseCommit (the handler ran its own
		// COMMIT): completed, no response yet, the same request.
		answerCommitted: `UPDATE ` + t + ` SET error_code = $5, error = $6,
				response_status = $7, response_headers = $8, response_body = $9, response_ref = $10
			WHERE consumer = $1 AND tenant = $2 AND key = $3 AND fingerprint = $4
				AND state = 'completed' AND response_status IS NULL`,
		answerCommittedLease: `UPDATE ` + t + ` SET state = 'completed', completed_at = now(), lease_until = NULL,
				expires_at = now() + $5::interval, error_code = $6, error = $7,
				response_status = $8, response_headers = $9, response_body = $10, response_ref = $11
			WHERE consumer = $1 AND tenant = $2 AND key = $3 AND fence = $4 AND state = 'processing'`,
		// Only a settled row past its expiry goes; a processing row is never touched.
		deleteExpiredKey: `DELETE FROM ` + t + `
			WHERE consumer = $1 AND tenant = $2 AND key = $3
				AND state IN ('completed', 'failed') AND expires_at < now()`,
	}
}

// responseQueriesBySchema caches the rendered statements per schema.
var responseQueriesBySchema sync.Map

func (s *Store) rq() responseQueries {
	if q, ok := responseQueriesBySchema.Load(s.schema); ok {
		return q.(responseQueries)
	}
	q := newResponseQueries(quoteIdent(s.schema))
	responseQueriesBySchema.Store(s.schema, q)
	return q
}

// responseArgs are a response's column values, in column order.
func responseArgs(r *Response) []any {
	if r == nil {
		return []any{nil, nil, nil, nil}
	}
	var ref *string
	if r.BodyRef != "" {
		ref = &r.BodyRef
	}
	body := r.Body
	if ref != nil {
		body = nil
	} else if body == nil {
		body = []byte{} // an empty body, as opposed to none stored
	}
	return []any{int16(r.Status), EncodeHeader(r.Header), body, ref}
}

// ValidateResponse checks what a stored response may hold.
func ValidateResponse(r *Response) error {
	if r.Status < 100 || r.Status > 599 {
		return fmt.Errorf("response status %d is outside 100..599", r.Status)
	}
	if r.BodyRef != "" {
		if err := ValidateKey(r.BodyRef); err != nil {
			return fmt.Errorf("response body reference: %w", err)
		}
	}
	return nil
}

var headerNewlines = strings.NewReplacer("\r", " ", "\n", " ")

// EncodeHeader writes h as HTTP/1.1 header lines, "Name: value\r\n", sorted by
// name, values in their order: the response_headers column. CR and LF in a value
// become spaces, as net/http does when it writes a header.
func EncodeHeader(h map[string][]string) []byte {
	names := make([]string, 0, len(h))
	for name := range h {
		names = append(names, name)
	}
	slices.Sort(names)
	var b bytes.Buffer
	for _, name := range names {
		for _, v := range h[name] {
			b.WriteString(name)
			b.WriteString(": ")
			b.WriteString(headerNewlines.Replace(v))
			b.WriteString("\r\n")
		}
	}
	return b.Bytes()
}

// DecodeHeader reads what EncodeHeader wrote.
func DecodeHeader(b []byte) map[string][]string {
	h := map[string][]string{}
	for line := range bytes.SplitSeq(b, []byte("\r\n")) {
		name, value, ok := bytes.Cut(line, []byte(": "))
		if !ok {
			continue
		}
		h[string(name)] = append(h[string(name)], string(value))
	}
	return h
}

// ClaimResponseTx is ClaimAfterTx for HTTP keys: in one round trip it sends the
// prelude statements (BEGIN), marks the transaction with TxMark and sets its
// lock_timeout to wait (the bound on waiting for a concurrent claim of the key;
// 0 is no bound), and claims c. On a conflict it reads the existing row together with its stored
// response. A settled row past its expires_at is deleted in tx and the key claimed
// as new (ReplacedExpired). A claim returns Row, for SaveResponseCommit.
func (s *Store) ClaimResponseTx(ctx context.Context, tx interface {
	DBTX
	BatchSender
}, prelude []string, c Claim, wait time.Duration) (ResponseClaim, error) {
	if err := c.Validate(); err != nil {
		return ResponseClaim{}, err
	}
	var row RowRef
	pipelined := false
	res, err := s.insertOrResponse(ctx, tx, c, func() (int64, error) {
		if pipelined {
			return 0, tx.QueryRow(ctx, s.rq().claim, c.Consumer, c.Tenant, c.Key, c.Fingerprint, retentionOf(c.Retention)).Scan(&row.tid)
		}
		pipelined = true
		b := &pgx.Batch{}
		for _, sql := range prelude {
			b.Queue(sql)
		}
		b.Queue(s.rq().markWait, strconv.FormatInt(max(wait.Milliseconds(), 0), 10))
		b.Queue(s.rq().claim, c.Consumer, c.Tenant, c.Key, c.Fingerprint, retentionOf(c.Retention))
		br := tx.SendBatch(ctx, b)
		for range len(prelude) + 1 {
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

// RowRef locates a row that ClaimResponseTx inserted, inside the transaction that
// inserted it: its ctid, which nothing but that transaction can change before it
// ends. SaveResponseCommit finds the row by it without an index lookup. The zero
// value locates nothing.
type RowRef struct{ tid pgtype.TID }

// LeaseResponse is Lease for HTTP keys: it commits a processing row with a lease
// at once (db outside a transaction), or takes over a processing row whose lease
// ran out (fence + 1, Attempts + 1). On a conflict it returns the existing row and
// its stored response; a settled row past its expires_at is deleted and the key
// leased as new.
func (s *Store) LeaseResponse(ctx context.Context, db DBTX, c Claim, lease time.Duration) (ResponseClaim, error) {
	if err := c.Validate(); err != nil {
		return ResponseClaim{}, err
	}
	return s.insertOrResponse(ctx, db, c, func() (int64, error) {
		var fence int64
		err := db.QueryRow(ctx, s.q.lease, c.Consumer, c.Tenant, c.Key, c.Fingerprint, retentionOf(c.Retention), lease).Scan(&fence)
		return fence, err
	})
}

// insertOrResponse is insertOr that reads the existing row with its response, and
// replaces an expired settled row.
func (s *Store) insertOrResponse(ctx context.Context, db DBTX, c Claim, insert func() (int64, error)) (ResponseClaim, error) {
	var out ResponseClaim
	for {
		fence, err := insert()
		if err == nil {
			out.ClaimResult = ClaimResult{Claimed: true, Fence: fence}
			return out, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return out, s.wrapResponse(err)
		}
		rec, resp, err := s.GetResponse(ctx, db, c.ID)
		if errors.Is(err, ErrNotFound) {
			continue // deleted in between (a janitor, a released lease): insert again
		}
		if err != nil {
			return out, err
		}
		if rec.State != StateProcessing && rec.ExpiresAt.Before(rec.Now) {
			if _, err := db.Exec(ctx, s.rq().deleteExpiredKey, c.Consumer, c.Tenant, c.Key); err != nil {
				return out, s.wrapResponse(err)
			}
			out.ReplacedExpired = true
			continue
		}
		out.ClaimResult = s.existing(rec, c.Fingerprint)
		out.Response = resp
		return out, nil
	}
}

// SaveResponseTx stores resp on id's row, in the transaction that claimed it with
// ClaimResponseTx and holds the handler's work, so the response commits with the
// work or not at all.
func (s *Store) SaveResponseTx(ctx context.Context, tx DBTX, id ID, resp *Response) error {
	if err := ValidateResponse(resp); err != nil {
		return err
	}
	args := append([]any{id.Consumer, id.Tenant, id.Key}, responseArgs(resp)...)
	tag, err := tx.Exec(ctx, s.rq().save, args...)
	if err != nil {
		return s.wrapResponse(err)
	}
	if tag.RowsAffected() != 1 {
		return fmt.Errorf("idem: no completed inbox row for consumer %q key %q to store the response on (was it claimed in this transaction?)", id.Consumer, id.Key)
	}
	return nil
}

// ErrCommitUnknown: COMMIT was sent and failed, so whether the transaction
// committed is unknown (a connection cut mid-commit). The key settles it: a retry
// finds the row, or runs again.
var ErrCommitUnknown = newError("commit_unknown", "COMMIT failed; whether the transaction committed is unknown", false)

// SaveResponseCommit stores resp on id's row and commits, in one round trip. conn
// must be running the transaction that claimed id with ClaimResponseTx, whose Row
// is row, begun with plain SQL ("begin") rather than through pgx's Tx, which would
// not know that it ended. If the transaction is not that one any more
// (ErrTxReplaced: it lost ClaimResponseTx's mark) or no completed row takes the
// response, nothing commits: the COMMIT behind the failed statement is never
// executed and the transaction is left failed, for the caller to roll back. A
// failed COMMIT returns ErrCommitUnknown.
func (s *Store) SaveResponseCommit(ctx context.Context, conn BatchSender, id ID, row RowRef, resp *Response) error {
	if err := ValidateResponse(resp); err != nil {
		return err
	}
	args := append([]any{id.Consumer, id.Tenant, id.Key, row.tid}, responseArgs(resp)...)
	return s.commitAfter(ctx, conn, s.rq().saveOrFail, args, func() error {
		return fmt.Errorf("idem: no completed inbox row for consumer %q key %q to store the response on", id.Consumer, id.Key)
	})
}

// CompleteLeaseResponseCommit is CompleteLeaseResponseTx and COMMIT in one round
// trip, in a transaction marked with TxMark; a fence that no longer matches returns
// ErrLeaseLost and a missing mark ErrTxReplaced, and neither commits anything.
func (s *Store) CompleteLeaseResponseCommit(ctx context.Context, conn BatchSender, id ID, fence int64, retention time.Duration, resp *Response) error {
	if err := ValidateResponse(resp); err != nil {
		return err
	}
	args := append([]any{id.Consumer, id.Tenant, id.Key, fence, retentionOf(retention)}, responseArgs(resp)...)
	return s.commitAfter(ctx, conn, s.rq().completeLeaseOrFail, args, func() error { return ErrLeaseLost })
}

// commitAfter sends an "OrFail" statement and COMMIT in one batch. A missing mark
// is ErrTxReplaced; a division by zero is noRow. Either way nothing commits: the
// COMMIT behind a failed statement is never executed.
func (s *Store) commitAfter(ctx context.Context, conn BatchSender, sql string, args []any, noRow func() error) error {
	b := &pgx.Batch{}
	b.Queue(sql, args...)
	b.Queue("commit")
	br := conn.SendBatch(ctx, b)
	var one int
	if err := br.QueryRow().Scan(&one); err != nil {
		_ = br.Close()
		var pgErr interface{ SQLState() string }
		switch {
		case txMarkGone(err):
			return ErrTxReplaced
		case errors.As(err, &pgErr) && pgErr.SQLState() == "22012":
			return noRow()
		}
		return s.wrapResponse(err)
	}
	return commitResult(br)
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
func (s *Store) AnswerCommitted(ctx context.Context, db DBTX, c Claim, fence int64, code, msg string, resp *Response) (bool, error) {
	if err := c.Validate(); err != nil {
		return false, err
	}
	if err := ValidateResponse(resp); err != nil {
		return false, err
	}
	sql, args := s.rq().answerCommitted, []any{c.Consumer, c.Tenant, c.Key, c.Fingerprint, code, msg}
	if fence != 0 {
		sql, args = s.rq().answerCommittedLease, []any{c.Consumer, c.Tenant, c.Key, fence, retentionOf(c.Retention), code, msg}
	}
	tag, err := db.Exec(ctx, sql, append(args, responseArgs(resp)...)...)
	if err != nil {
		return false, s.wrapResponse(err)
	}
	return tag.RowsAffected() == 1, nil
}

// FailResponseTx records c as failed with its response (a final client error),
// unless the key already has a row, whose outcome and response it then returns.
// Call it in a transaction of its own, after the handler's transaction rolled back.
func (s *Store) FailResponseTx(ctx context.Context, tx DBTX, c Claim, code, msg string, resp *Response) (ResponseClaim, error) {
	if err := c.Validate(); err != nil {
		return ResponseClaim{}, err
	}
	if err := ValidateResponse(resp); err != nil {
		return ResponseClaim{}, err
	}
	args := append([]any{c.Consumer, c.Tenant, c.Key, c.Fingerprint, retentionOf(c.Retention), code, msg}, responseArgs(resp)...)
	return s.insertOrResponse(ctx, tx, c, func() (int64, error) {
		var inserted bool
		return 0, tx.QueryRow(ctx, s.rq().fail, args...).Scan(&inserted)
	})
}

// CompleteLeaseResponseTx is CompleteLeaseTx that stores resp on the row too.
func (s *Store) CompleteLeaseResponseTx(ctx context.Context, tx DBTX, id ID, fence int64, retention time.Duration, resp *Response) error {
	if err := ValidateResponse(resp); err != nil {
		return err
	}
	args := append([]any{id.Consumer, id.Tenant, id.Key, fence, retentionOf(retention)}, responseArgs(resp)...)
	tag, err := tx.Exec(ctx, s.rq().completeLease, args...)
	if err != nil {
		return s.wrapResponse(err)
	}
	if tag.RowsAffected() == 0 {
		return ErrLeaseLost
	}
	return nil
}

// FailLeaseResponse is FailLease that stores resp on the row too.
func (s *Store) FailLeaseResponse(ctx context.Context, db DBTX, id ID, fence int64, retention time.Duration, code, msg string, resp *Response) error {
	if err := ValidateResponse(resp); err != nil {
		return err
	}
	args := append([]any{id.Consumer, id.Tenant, id.Key, fence, retentionOf(retention), code, msg}, responseArgs(resp)...)
	tag, err := db.Exec(ctx, s.rq().failLease, args...)
	if err != nil {
		return s.wrapResponse(err)
	}
	if tag.RowsAffected() == 0 {
		return ErrLeaseLost
	}
	return nil
}

// GetResponse reads one inbox row and its stored response (nil when it has none),
// or returns ErrNotFound.
func (s *Store) GetResponse(ctx context.Context, db DBTX, id ID) (*Record, *Response, error) {
	var r Record
	var code, msg, ref *string
	var status *int16
	var header, body []byte
	err := db.QueryRow(ctx, s.rq().get, id.Consumer, id.Tenant, id.Key).Scan(
		&r.Consumer, &r.Tenant, &r.Key, &r.Fingerprint, &r.State, &code, &msg, &r.Attempts,
		&r.LeaseUntil, &r.Fence, &r.ReceivedAt, &r.CompletedAt, &r.ExpiresAt, &r.Now,
		&status, &header, &body, &ref)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil, ErrNotFound
	}
	if err != nil {
		return nil, nil, s.wrapResponse(err)
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
	resp := &Response{Status: int(*status), Header: DecodeHeader(header), Body: body}
	if ref != nil {
		resp.BodyRef = *ref
	}
	return &r, resp, nil
}

// wrapResponse turns a missing column (42703: migration 003 has not run) into
// ErrSchemaMissing, as wrap does for a missing table.
func (s *Store) wrapResponse(err error) error {
	var pgErr interface{ SQLState() string }
	if errors.As(err, &pgErr) && pgErr.SQLState() == "42703" {
		return fmt.Errorf("%w (schema %q lacks the response columns of migration 003): %v", ErrSchemaMissing, s.schema, err)
	}
	return s.wrap(err)
}
