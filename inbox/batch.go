package inbox

import (
	"cmp"
	"context"
	"fmt"
	"slices"

	"github.com/jackc/pgx/v5"
)

// BatchClaim is one key of a set-based claim (ClaimBatchTx).
type BatchClaim struct {
	Claim
	// Failed writes the row as failed, with Code and Error, instead of claiming the
	// key for a handler: a permanent failure recorded in the batch's transaction, as
	// FailTx records one. Code and Error are stored through SanitizeText.
	Failed      bool
	Code, Error string
}

// ClaimBatchTx claims many keys inside the caller's transaction with one statement,
// INSERT … SELECT FROM unnest(…) ON CONFLICT DO NOTHING, which writes each row as
// completed (or as failed, for a BatchClaim with Failed set): the rows become
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
// claimed again.
//
// prelude statements go ahead of the claim in the same round trip, as in
// ClaimAfterTx; with no claims, only the prelude is sent. claims must name
// distinct keys.
func (s *Store) ClaimBatchTx(ctx context.Context, tx interface {
	DBTX
	BatchSender
}, prelude []string, claims []BatchClaim) ([]ClaimResult, error) {
	results := make([]ClaimResult, len(claims))
	pos := make(map[string]int, len(claims))
	for i := range claims {
		c := &claims[i]
		if err := c.Validate(); err != nil {
			return nil, err
		}
		k := idKey(c.ID)
		if _, dup := pos[k]; dup {
			return nil, fmt.Errorf("inbox: ClaimBatchTx given consumer %q key %q twice; claims must name distinct keys", c.Consumer, c.Key)
		}
		pos[k] = i
	}
	if len(claims) == 0 {
		if len(prelude) == 0 {
			return results, nil
		}
		b := &pgx.Batch{}
		for _, sql := range prelude {
			b.Queue(sql)
		}
		return results, s.wrap(tx.SendBatch(ctx, b).Close())
	}

	order := make([]int, len(claims))
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int {
		x, y := &claims[a], &claims[b]
		return cmp.Or(cmp.Compare(x.Consumer, y.Consumer), cmp.Compare(x.Tenant, y.Tenant), cmp.Compare(x.Key, y.Key))
	})

	settled := make([]bool, len(claims))
	todo := order
	for first := true; len(todo) > 0; first = false {
		var rows []batchRow
		var err error
		if first {
			rows, err = s.claimBatch(ctx, tx, prelude, claims, todo)
		} else {
			rows, err = s.claimBatch(ctx, tx, nil, claims, todo)
		}
		if err != nil {
			return nil, err
		}
		s.settle(rows, pos, claims, results, settled)
		var unread []int
		for _, i := range todo {
			if !settled[i] {
				unread = append(unread, i)
			}
		}
		if len(unread) == 0 {
			break
		}
		// Conflicts with claimers that committed while the INSERT waited: a new
		// statement, with a new snapshot, sees their rows.
		rows, err = s.getBatch(ctx, tx, claims, unread)
		if err != nil {
			return nil, err
		}
		s.settle(rows, pos, claims, results, settled)
		todo = todo[:0:0]
		for _, i := range unread {
			if !settled[i] {
				todo = append(todo, i) // deleted in between: claim it again
			}
		}
	}
	return results, nil
}

// batchRow is one row of claimBatch or getBatch: a key claimed, or the row found.
type batchRow struct {
	claimed bool
	rec     Record
}

// settle records what rows say about the claims. A key that comes back claimed
// wins over the same key's earlier row (deleted, then claimed again).
func (s *Store) settle(rows []batchRow, pos map[string]int, claims []BatchClaim, results []ClaimResult, settled []bool) {
	for _, r := range rows {
		i, ok := pos[idKey(ID{Consumer: r.rec.Consumer, Tenant: r.rec.Tenant, Key: r.rec.Key})]
		if !ok {
			continue
		}
		if r.claimed {
			results[i] = ClaimResult{Claimed: true}
			settled[i] = true
			continue
		}
		if settled[i] && results[i].Claimed {
			continue
		}
		rec := r.rec
		results[i] = s.existing(&rec, claims[i].Fingerprint)
		settled[i] = true
	}
}

func (s *Store) claimBatch(ctx context.Context, tx interface {
	DBTX
	BatchSender
}, prelude []string, claims []BatchClaim, idx []int) ([]batchRow, error) {
	n := len(idx)
	consumers, tenants, keys := make([]string, n), make([]string, n), make([]string, n)
	fps := make([][]byte, n)
	states := make([]string, n)
	codes, msgs := make([]*string, n), make([]*string, n)
	retention := make([]int64, n)
	for j, i := range idx {
		c := &claims[i]
		consumers[j], tenants[j], keys[j], fps[j] = c.Consumer, c.Tenant, c.Key, c.Fingerprint
		states[j] = string(StateCompleted)
		if c.Failed {
			states[j] = string(StateFailed)
			code, msg := SanitizeText(c.Code, 0), SanitizeText(c.Error, 0)
			codes[j], msgs[j] = &code, &msg
		}
		retention[j] = retentionOf(c.Retention).Microseconds()
	}
	args := []any{consumers, tenants, keys, fps, states, codes, msgs, retention}
	if len(prelude) == 0 {
		rows, err := tx.Query(ctx, s.q.claimBatch, args...)
		if err != nil {
			return nil, s.wrap(err)
		}
		return s.scanBatch(rows)
	}
	b := &pgx.Batch{}
	for _, sql := range prelude {
		b.Queue(sql)
	}
	b.Queue(s.q.claimBatch, args...)
	br := tx.SendBatch(ctx, b)
	for range prelude {
		if _, err := br.Exec(); err != nil {
			_ = br.Close()
			return nil, s.wrap(err)
		}
	}
	rows, err := br.Query()
	if err != nil {
		_ = br.Close()
		return nil, s.wrap(err)
	}
	out, err := s.scanBatch(rows)
	if cerr := br.Close(); err == nil && cerr != nil {
		err = s.wrap(cerr)
	}
	return out, err
}

func (s *Store) getBatch(ctx context.Context, db DBTX, claims []BatchClaim, idx []int) ([]batchRow, error) {
	n := len(idx)
	consumers, tenants, keys := make([]string, n), make([]string, n), make([]string, n)
	for j, i := range idx {
		consumers[j], tenants[j], keys[j] = claims[i].Consumer, claims[i].Tenant, claims[i].Key
	}
	rows, err := db.Query(ctx, s.q.getBatch, consumers, tenants, keys)
	if err != nil {
		return nil, s.wrap(err)
	}
	return s.scanBatch(rows)
}

func (s *Store) scanBatch(rows pgx.Rows) ([]batchRow, error) {
	defer rows.Close()
	var out []batchRow
	for rows.Next() {
		var r batchRow
		var state, code, msg *string
		if err := rows.Scan(&r.claimed, &r.rec.Consumer, &r.rec.Tenant, &r.rec.Key, &r.rec.Fingerprint,
			&state, &code, &msg, &r.rec.Attempts, &r.rec.LeaseUntil, &r.rec.Fence,
			&r.rec.ReceivedAt, &r.rec.CompletedAt, &r.rec.ExpiresAt, &r.rec.Now); err != nil {
			return nil, s.wrap(err)
		}
		if state != nil {
			r.rec.State = State(*state)
		}
		if code != nil {
			r.rec.ErrorCode = *code
		}
		if msg != nil {
			r.rec.Error = *msg
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, s.wrap(err)
	}
	return out, nil
}

// idKey is a map key for an ID; NUL cannot occur in any of its parts.
func idKey(id ID) string { return id.Consumer + "\x00" + id.Tenant + "\x00" + id.Key }
