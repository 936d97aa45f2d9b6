package consumer

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/failgroup"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/pgarray"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/text"
)

// batchStore claims the keys of a group-commit batch, or of a HandleBatch batch,
// in the inbox of one schema, with the inbox table's statements (internal/inboxdb).
type batchStore struct {
	schema string
	q      inboxdb.Queries
}

// newBatchStore returns the batch claimer for schema, which the Config has
// validated.
func newBatchStore(schema string) *batchStore {
	return &batchStore{schema: schema, q: inboxdb.New(schema)}
}

// batchClaim is one key of a set-based claim (ClaimBatchTx).
type batchClaim struct {
	inboxdb.Claim
	// Failed writes the row as failed, with Code and Error, instead of claiming the
	// key for a handler: a permanent failure recorded in the batch's transaction, as
	// FailTx records one. Code and Error are sanitised (valid UTF-8, no NUL bytes).
	Failed      bool
	Code, Error string
}

// ClaimBatchTx claims many keys inside the caller's transaction with one statement,
// INSERT … SELECT FROM unnest(…) ON CONFLICT DO NOTHING, which writes each row as
// completed (or as failed, for a batchClaim with Failed set): the rows become
// visible only if the transaction commits, together with the handlers' work.
// results[i] is claims[i]'s, with the meaning ClaimTx gives it.
//
// The keys are inserted in (consumer, tenant, key) order, whatever order claims
// has, so two batches that share keys take their row locks in the same order and
// cannot deadlock. A key that another transaction holds uncommitted makes the
// statement wait for it, bounded by the caller's lock_timeout; a lock timeout fails
// the whole statement (and aborts the transaction, or the savepoint the caller made
// before it), without saying which key it was.
//
// The same statement reads the committed rows of the keys it did not insert, as
// far as its snapshot sees them, so a redelivery of a long-committed key costs no
// second statement. Only a key whose row was committed by a claimer that the
// statement had to wait for is read by one more statement; at READ COMMITTED that
// statement sees the row. A key whose row vanished in between (the janitor) is
// claimed again. A key whose row is settled and past its expires_at is forgotten:
// one statement deletes all such rows of the batch, in tx, and their keys are
// claimed again (Expired).
//
// A batch whose keys all belong to one tenant is claimed with the statements'
// one-tenant forms (inboxdb), which also filter on that tenant, so that a router
// by tenant can send them to its shard; a batch of several tenants, with the
// others.
//
// each claims the keys with the per-message statements instead (inboxdb's Claim,
// or Fail for a recorded failure), one a key, pipelined in the same round trip:
// the form for Citus, which runs the one INSERT … SELECT through the coordinator
// and commits it with two-phase commit even when one worker holds every key,
// while single-row inserts on one worker commit with one phase. Each key it does
// not insert is read by the one more statement above.
//
// prelude statements go ahead of the claim in the same round trip, as in
// ClaimAfterTx; with no claims, only the prelude is sent. claims must name
// distinct keys.
func (s *batchStore) ClaimBatchTx(ctx context.Context, tx interface {
	inboxdb.DBTX
	inboxdb.BatchSender
}, prelude []string, claims []batchClaim, each bool) ([]inboxdb.ClaimResult, error) {
	results := make([]inboxdb.ClaimResult, len(claims))
	for i := range claims {
		if err := claims[i].Validate(); err != nil {
			return nil, err
		}
	}
	if len(claims) == 0 {
		if len(prelude) == 0 {
			return results, nil
		}
		b := &pgx.Batch{}
		for _, sql := range prelude {
			b.Queue(sql)
		}
		return results, pgschema.Wrap(tx.SendBatch(ctx, b).Close(), s.schema)
	}

	order := make([]int, len(claims))
	for i := range order {
		order[i] = i
	}
	cmpID := func(a, b int) int {
		x, y := &claims[a], &claims[b]
		return cmp.Or(cmp.Compare(x.Consumer, y.Consumer), cmp.Compare(x.Tenant, y.Tenant), cmp.Compare(x.Key, y.Key))
	}
	slices.SortFunc(order, cmpID)
	for j := 1; j < len(order); j++ {
		if cmpID(order[j-1], order[j]) == 0 {
			c := &claims[order[j]]
			return nil, fmt.Errorf("idem: ClaimBatchTx given consumer %q key %q twice; claims must name distinct keys", c.Consumer, c.Key)
		}
	}

	// settled[i]: results[i] holds what the last statement found for claims[i].
	settled := make([]bool, len(claims))
	found := func(i int, rec *inboxdb.Record) {
		c := &claims[i]
		rec.Consumer, rec.Tenant, rec.Key = c.Consumer, c.Tenant, c.Key
		results[i] = inboxdb.ClaimResult{Existing: rec, Mismatch: !bytes.Equal(rec.Fingerprint, c.Fingerprint)}
		settled[i] = true
	}
	expired := make([]bool, len(claims))
	todo := order
	for first := true; len(todo) > 0; first = false {
		p := prelude
		if !first {
			p = nil
		}
		claim := s.claimBatch
		if each {
			claim = s.claimEach
		}
		unread, err := claim(ctx, tx, p, claims, todo, found)
		if err != nil {
			return nil, err
		}
		for _, i := range todo {
			if !settled[i] && !slices.Contains(unread, i) {
				results[i], settled[i] = inboxdb.ClaimResult{Claimed: true}, true
			}
		}
		if len(unread) > 0 {
			// Conflicts with claimers that committed while the INSERT waited: a new
			// statement, with a new snapshot, sees their rows.
			if err := s.getBatch(ctx, tx, claims, unread, found); err != nil {
				return nil, err
			}
		}
		var gone []int
		for _, i := range todo {
			if settled[i] && !results[i].Claimed && results[i].Existing.Expired() {
				settled[i], expired[i] = false, true
				gone = append(gone, i)
			}
		}
		if len(gone) > 0 {
			if err := s.deleteExpiredBatch(ctx, tx, claims, gone); err != nil {
				return nil, err
			}
		}
		next := todo[:0:0]
		for _, i := range todo {
			if !settled[i] {
				next = append(next, i) // deleted in between, or expired: claim it again
			}
		}
		todo = next
	}
	for i := range results {
		results[i].Expired = expired[i] && results[i].Claimed
	}
	return results, nil
}

// keyColumns are the consumers, tenants and keys of claims[idx], as ClaimBatch,
// GetBatch and DeleteExpiredKeys take them. one says whether every key has the
// same tenant (then the statements' one-tenant forms apply, with tenants[0]).
func keyColumns(claims []batchClaim, idx []int) (consumers, tenants, keys pgarray.Text, one bool) {
	n := len(idx)
	consumers, tenants, keys = make(pgarray.Text, n), make(pgarray.Text, n), make(pgarray.Text, n)
	one = true
	for j, i := range idx {
		consumers[j], tenants[j], keys[j] = claims[i].Consumer, claims[i].Tenant, claims[i].Key
		one = one && tenants[j] == tenants[0]
	}
	return consumers, tenants, keys, one
}

// deleteExpiredBatch deletes the settled rows past their expiry of claims[idx].
func (s *batchStore) deleteExpiredBatch(ctx context.Context, db inboxdb.DBTX, claims []batchClaim, idx []int) error {
	consumers, tenants, keys, one := keyColumns(claims, idx)
	sql, args := s.q.DeleteExpiredKeys, []any{consumers, tenants, keys}
	if one {
		sql, args = s.q.DeleteExpiredKeysOneTenant, append(args, tenants[0])
	}
	_, err := db.Exec(ctx, sql, args...)
	return pgschema.Wrap(err, s.schema)
}

// claimBatch runs the claim of claims[idx] (prelude first, in the same round trip)
// and hands each row it read to found. It returns the keys it neither claimed nor
// read (unread): their rows were committed while the claim waited for them.
func (s *batchStore) claimBatch(ctx context.Context, tx interface {
	inboxdb.DBTX
	inboxdb.BatchSender
}, prelude []string, claims []batchClaim, idx []int, found func(int, *inboxdb.Record)) (unread []int, err error) {
	n := len(idx)
	consumers, tenants, keys, one := keyColumns(claims, idx)
	fps := make(pgarray.Bytea, n)
	retention := make(pgarray.Int8, n)
	// failed, codes and msgs stay nil (NULL arrays, which unnest pads with NULLs)
	// unless some claim records a failure: the common batch sends less.
	var failed []bool
	var codes, msgs, masked pgarray.Text
	for j, i := range idx {
		c := &claims[i]
		fps[j] = c.Fingerprint
		if c.Failed {
			if failed == nil {
				failed, codes, msgs, masked = make([]bool, n), make(pgarray.Text, n), make(pgarray.Text, n), make(pgarray.Text, n)
			}
			failed[j] = true
			codes[j], msgs[j] = text.Sanitize(c.Code, 0), text.Sanitize(c.Error, 0)
			masked[j] = failgroup.Mask(msgs[j])
		}
		retention[j] = cmp.Or(c.Retention, inbox.DefaultRetention).Microseconds()
	}
	sql, args := s.q.ClaimBatch, []any{consumers, tenants, keys, fps, failed, codes, msgs, retention, masked}
	if one {
		sql, args = s.q.ClaimBatchOneTenant, append(args, tenants[0])
	}
	scan := func(rows pgx.Rows) error {
		return s.scanRows(rows, idx, func(i int, rec *inboxdb.Record) {
			if rec == nil {
				unread = append(unread, i)
				return
			}
			found(i, rec)
		})
	}
	if len(prelude) == 0 {
		rows, err := tx.Query(ctx, sql, args...)
		if err != nil {
			return nil, pgschema.Wrap(err, s.schema)
		}
		return unread, scan(rows)
	}
	b := &pgx.Batch{}
	for _, sql := range prelude {
		b.Queue(sql)
	}
	b.Queue(sql, args...)
	br := tx.SendBatch(ctx, b)
	for range prelude {
		if _, err := br.Exec(); err != nil {
			_ = br.Close()
			return nil, pgschema.Wrap(err, s.schema)
		}
	}
	rows, err := br.Query()
	if err != nil {
		_ = br.Close()
		return nil, pgschema.Wrap(err, s.schema)
	}
	err = scan(rows)
	if cerr := br.Close(); err == nil && cerr != nil {
		err = pgschema.Wrap(cerr, s.schema)
	}
	return unread, err
}

// claimEach is claimBatch with one single-row claim a key (ClaimBatchTx's each),
// in one batch after prelude. It reads no row: every key it did not insert is
// unread.
func (s *batchStore) claimEach(ctx context.Context, tx interface {
	inboxdb.DBTX
	inboxdb.BatchSender
}, prelude []string, claims []batchClaim, idx []int, _ func(int, *inboxdb.Record)) (unread []int, err error) {
	b := &pgx.Batch{}
	for _, sql := range prelude {
		b.Queue(sql)
	}
	for _, i := range idx {
		c := &claims[i]
		retention := cmp.Or(c.Retention, inbox.DefaultRetention)
		if c.Failed {
			code, msg := text.Sanitize(c.Code, 0), text.Sanitize(c.Error, 0)
			b.Queue(s.q.Fail, c.Consumer, c.Tenant, c.Key, c.Fingerprint, retention, code, msg, failgroup.Mask(msg))
			continue
		}
		b.Queue(s.q.Claim, c.Consumer, c.Tenant, c.Key, c.Fingerprint, retention)
	}
	br := tx.SendBatch(ctx, b)
	defer func() {
		if cerr := br.Close(); err == nil && cerr != nil {
			err = pgschema.Wrap(cerr, s.schema)
		}
	}()
	for range prelude {
		if _, err := br.Exec(); err != nil {
			return nil, pgschema.Wrap(err, s.schema)
		}
	}
	for _, i := range idx {
		var inserted bool
		switch err := br.QueryRow().Scan(&inserted); {
		case errors.Is(err, pgx.ErrNoRows):
			unread = append(unread, i)
		case err != nil:
			return nil, pgschema.Wrap(err, s.schema)
		}
	}
	return unread, nil
}

// getBatch reads the rows of claims[idx] and hands each to found.
func (s *batchStore) getBatch(ctx context.Context, db inboxdb.DBTX, claims []batchClaim, idx []int, found func(int, *inboxdb.Record)) error {
	consumers, tenants, keys, one := keyColumns(claims, idx)
	sql, args := s.q.GetBatch, []any{consumers, tenants, keys}
	if one {
		sql, args = s.q.GetBatchOneTenant, append(args, tenants[0])
	}
	rows, err := db.Query(ctx, sql, args...)
	if err != nil {
		return pgschema.Wrap(err, s.schema)
	}
	return s.scanRows(rows, idx, func(i int, rec *inboxdb.Record) {
		if rec != nil {
			found(i, rec)
		}
	})
}

// scanRows hands each row of ClaimBatch or GetBatch to row: the claim it is about
// (idx[ord-1]) and the inbox row read, nil when none was.
func (s *batchStore) scanRows(rows pgx.Rows, idx []int, row func(i int, rec *inboxdb.Record)) error {
	defer rows.Close()
	var ord int
	var state, code, msg *string
	var attempts *int
	var fence *int64
	var received, expires, now *time.Time
	for rows.Next() {
		rec := &inboxdb.Record{}
		if err := rows.Scan(&ord, &rec.Fingerprint, &state, &code, &msg, &attempts, &rec.LeaseUntil, &fence,
			&received, &rec.CompletedAt, &expires, &now); err != nil {
			return pgschema.Wrap(err, s.schema)
		}
		if ord < 1 || ord > len(idx) {
			return fmt.Errorf("idem: the batch claim returned key number %d of %d", ord, len(idx))
		}
		if state == nil {
			row(idx[ord-1], nil)
			continue
		}
		rec.State = inboxdb.State(*state)
		rec.ErrorCode, rec.Error = deref(code), deref(msg)
		rec.Attempts, rec.Fence = deref(attempts), deref(fence)
		rec.ReceivedAt, rec.ExpiresAt, rec.Now = deref(received), deref(expires), deref(now)
		row(idx[ord-1], rec)
	}
	return pgschema.Wrap(rows.Err(), s.schema)
}

func deref[T any](p *T) T {
	var zero T
	if p == nil {
		return zero
	}
	return *p
}
