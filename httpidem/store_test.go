package httpidem

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/internal/txmark"
	"github.com/idemkit/idem/janitor"
)

// setupResponses is a response store on a fresh schema, and a pool on it.
func setupResponses(t *testing.T) (*responseStore, *pgxpool.Pool) {
	t.Helper()
	t.Parallel()
	pool, schema := pgtest.Setup(t)
	store, err := newResponseStore(schema)
	require.NoError(t, err)
	return store, pool
}

func httpClaim(key, fp string) inboxdb.Claim {
	return inboxdb.Claim{ID: inboxdb.ID{Consumer: "POST /payments", Tenant: "acme", Key: key}, Fingerprint: []byte(fp)}
}

// TestStoredResponseRoundTrip: a response saved in the claiming transaction comes
// back with the key, byte for byte, headers that are not UTF-8 included.
func TestStoredResponseRoundTrip(t *testing.T) {
	store, pool := setupResponses(t)
	ctx := context.Background()
	resp := &storedResponse{
		Status: 201,
		Header: map[string][]string{"Content-Type": {"application/json"}, "Link": {"<a>; rel=a", "<b>; rel=b"}, "X-Bin": {"\xff\x00é"}},
		Body:   []byte("{\"id\":\"pay_1\"}\x00\xff"),
	}
	var res responseClaim
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) (err error) {
		if res, err = store.ClaimResponseTx(ctx, tx, nil, httpClaim("k1", "fp"), time.Second); err != nil {
			return err
		}
		return store.SaveResponseTx(ctx, tx, httpClaim("k1", "fp").ID, resp)
	}))
	require.True(t, res.Claimed)

	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) (err error) {
		res, err = store.ClaimResponseTx(ctx, tx, nil, httpClaim("k1", "fp"), time.Second)
		return err
	}))
	require.False(t, res.Claimed)
	require.False(t, res.Mismatch)
	require.Equal(t, resp, res.Response)

	// An empty body is stored as empty, not as none; a header value with CR LF is
	// flattened, as net/http writes it.
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := store.ClaimResponseTx(ctx, tx, nil, httpClaim("k2", "fp"), time.Second); err != nil {
			return err
		}
		return store.SaveResponseTx(ctx, tx, httpClaim("k2", "fp").ID, &storedResponse{Status: 204, Header: map[string][]string{"X-A": {"a\r\nb"}}})
	}))
	_, got, err := store.GetResponse(ctx, pool, httpClaim("k2", "").ID)
	require.NoError(t, err)
	require.Equal(t, &storedResponse{Status: 204, Header: map[string][]string{"X-A": {"a  b"}}, Body: []byte{}}, got)

	// A row without a response (a message consumer's) reads as nil.
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		consumerStore, err := inboxdb.NewStore(store.Schema())
		if err != nil {
			return err
		}
		_, err = consumerStore.ClaimTx(ctx, tx, httpClaim("k3", "fp"))
		return err
	}))
	rec, got, err := store.GetResponse(ctx, pool, httpClaim("k3", "").ID)
	require.NoError(t, err)
	require.Nil(t, got)
	require.Equal(t, inboxdb.StateCompleted, rec.State)

	// Saving on a key this transaction did not claim is an error, not a silent no-op.
	require.Error(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return store.SaveResponseTx(ctx, tx, httpClaim("nope", "").ID, resp)
	}))
	require.Error(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return store.SaveResponseTx(ctx, tx, httpClaim("k3", "").ID, &storedResponse{Status: 42})
	}), "status outside 100..599")
}

// TestBodyReferenceStoresNoBody: with a reference, the body column stays NULL.
func TestBodyReferenceStoresNoBody(t *testing.T) {
	store, pool := setupResponses(t)
	ctx := context.Background()
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := store.ClaimResponseTx(ctx, tx, nil, httpClaim("k", "fp"), time.Second); err != nil {
			return err
		}
		return store.SaveResponseTx(ctx, tx, httpClaim("k", "").ID, &storedResponse{Status: 201, Body: []byte(`{"email":"ann@example.com"}`), BodyRef: "pay_1"})
	}))
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE response_body IS NULL AND response_ref = 'pay_1'`))
	_, got, err := store.GetResponse(ctx, pool, httpClaim("k", "").ID)
	require.NoError(t, err)
	require.Equal(t, &storedResponse{Status: 201, Header: map[string][]string{}, BodyRef: "pay_1"}, got)
}

// TestExpiredKeyIsClaimedAsNew: a settled row past expires_at is forgotten even
// before the janitor deletes it; a processing row never is.
func TestExpiredKeyIsClaimedAsNew(t *testing.T) {
	store, pool := setupResponses(t)
	ctx := context.Background()
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := store.ClaimResponseTx(ctx, tx, nil, httpClaim("k", "fp"), time.Second); err != nil {
			return err
		}
		return store.SaveResponseTx(ctx, tx, httpClaim("k", "").ID, &storedResponse{Status: 201, Body: []byte("old")})
	}))
	_, err := pool.Exec(ctx, `UPDATE inbox SET expires_at = now() - interval '1 second'`)
	require.NoError(t, err)

	var res responseClaim
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) (err error) {
		res, err = store.ClaimResponseTx(ctx, tx, nil, httpClaim("k", "other"), time.Second)
		return err
	}))
	require.True(t, res.Claimed)
	require.True(t, res.ReplacedExpired)
	rec, resp, err := store.GetResponse(ctx, pool, httpClaim("k", "").ID)
	require.NoError(t, err)
	require.Nil(t, resp, "the old response went with the old row")
	require.Equal(t, []byte("other"), rec.Fingerprint)

	// Lease mode: the same for settled rows; an expired *processing* row is a lease
	// to take over, never deleted.
	_, err = pool.Exec(ctx, `UPDATE inbox SET expires_at = now() - interval '1 second'`)
	require.NoError(t, err)
	lres, err := store.LeaseResponse(ctx, pool, httpClaim("k", "fp3"), time.Minute)
	require.NoError(t, err)
	require.True(t, lres.Claimed)
	require.True(t, lres.ReplacedExpired)
	_, err = pool.Exec(ctx, `UPDATE inbox SET expires_at = now() - interval '1 second'`)
	require.NoError(t, err)
	lres, err = store.LeaseResponse(ctx, pool, httpClaim("k", "fp3"), time.Minute)
	require.NoError(t, err)
	require.False(t, lres.Claimed, "a fresh lease is held, whatever expires_at says")
	require.Equal(t, inboxdb.StateProcessing, lres.Existing.State)
}

// TestLeaseWithResponse: complete and fail store the response under the fence; a
// stale fence stores nothing.
func TestLeaseWithResponse(t *testing.T) {
	store, pool := setupResponses(t)
	ctx := context.Background()
	c := httpClaim("k", "fp")
	res, err := store.LeaseResponse(ctx, pool, c, 50*time.Millisecond)
	require.NoError(t, err)
	require.True(t, res.Claimed)
	pgtest.WaitFor(t, 30*time.Second, "the stale lease to be taken over", func() bool {
		r, err := store.LeaseResponse(ctx, pool, c, time.Minute)
		require.NoError(t, err)
		if r.Claimed {
			require.Equal(t, res.Fence+1, r.Fence, "a stale lease is taken over with fence + 1")
			return true
		}
		return false
	})

	require.ErrorIs(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return store.CompleteLeaseResponseTx(ctx, tx, c.ID, res.Fence, 0, &storedResponse{Status: 201})
	}), inbox.ErrLeaseLost)
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return store.CompleteLeaseResponseTx(ctx, tx, c.ID, res.Fence+1, 0, &storedResponse{Status: 201, Body: []byte("ok")})
	}))
	rec, resp, err := store.GetResponse(ctx, pool, c.ID)
	require.NoError(t, err)
	require.Equal(t, inboxdb.StateCompleted, rec.State)
	require.Equal(t, "ok", string(resp.Body))

	c2 := httpClaim("k2", "fp")
	res, err = store.LeaseResponse(ctx, pool, c2, time.Minute)
	require.NoError(t, err)
	require.ErrorIs(t, store.FailLeaseResponse(ctx, pool, c2.ID, res.Fence+5, 0, "http_422", "422", &storedResponse{Status: 422}), inbox.ErrLeaseLost)
	require.NoError(t, store.FailLeaseResponse(ctx, pool, c2.ID, res.Fence, 0, "http_422", "Unprocessable Entity", &storedResponse{Status: 422, Body: []byte("no")}))
	rec, resp, err = store.GetResponse(ctx, pool, c2.ID)
	require.NoError(t, err)
	require.Equal(t, inboxdb.StateFailed, rec.State)
	require.Equal(t, "http_422", rec.ErrorCode)
	require.Equal(t, 422, resp.Status)
}

// TestFailResponseTx: a final client error is recorded with its response; a key
// that has a row keeps it, and the caller gets that row's response.
func TestFailResponseTx(t *testing.T) {
	store, pool := setupResponses(t)
	ctx := context.Background()
	var res responseClaim
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) (err error) {
		res, err = store.FailResponseTx(ctx, tx, httpClaim("k", "fp"), "http_400", "Bad Request", &storedResponse{Status: 400, Body: []byte("bad")})
		return err
	}))
	require.True(t, res.Claimed)
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) (err error) {
		res, err = store.FailResponseTx(ctx, tx, httpClaim("k", "fp"), "http_422", "x", &storedResponse{Status: 422})
		return err
	}))
	require.False(t, res.Claimed)
	require.Equal(t, inboxdb.StateFailed, res.Existing.State)
	require.Equal(t, 400, res.Response.Status)
	require.Equal(t, "bad", string(res.Response.Body))
}

// TestJanitorDeletesStoredResponses: the responses live on the inbox rows, so the
// janitor's delete takes them with their keys.
func TestJanitorDeletesStoredResponses(t *testing.T) {
	store, pool := setupResponses(t)
	ctx := context.Background()
	for _, k := range []string{"old", "new"} {
		require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if _, err := store.ClaimResponseTx(ctx, tx, nil, httpClaim(k, "fp"), time.Second); err != nil {
				return err
			}
			return store.SaveResponseTx(ctx, tx, httpClaim(k, "").ID, &storedResponse{Status: 201, Body: []byte("personal data")})
		}))
	}
	_, err := pool.Exec(ctx, `UPDATE inbox SET expires_at = now() - interval '1 second' WHERE key = 'old'`)
	require.NoError(t, err)
	j, err := janitor.New(janitor.Config{Pool: pool, Schema: store.Schema(), Pause: -1})
	require.NoError(t, err)
	st, err := j.RunOnce(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, st.InboxDeleted)
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE response_body IS NOT NULL`))
	require.Equal(t, 0, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE key = 'old'`))
}

// TestResponseColumnsMissing: a schema migrated only to 001 gives ErrSchemaMissing,
// which says to migrate.
func TestResponseColumnsMissing(t *testing.T) {
	store, pool := setupResponses(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `ALTER TABLE inbox DROP COLUMN response_status`)
	require.NoError(t, err)
	_, _, err = store.GetResponse(ctx, pool, httpClaim("k", "").ID)
	require.ErrorIs(t, err, inbox.ErrSchemaMissing)
	require.ErrorContains(t, err, "newer migration")
}

// TestSaveResponseCommit: the response and COMMIT go in one round trip; when the
// response finds no row, the COMMIT behind it does not run and the work of the
// transaction stays uncommitted.
func TestSaveResponseCommit(t *testing.T) {
	store, pool := setupResponses(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE work (n int)`)
	require.NoError(t, err)
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	c := conn.Conn()

	res, err := store.ClaimResponseTx(ctx, c, []string{"begin"}, httpClaim("k", "fp"), time.Second)
	require.NoError(t, err)
	require.True(t, res.Claimed)
	_, err = c.Exec(ctx, `INSERT INTO work VALUES (1)`)
	require.NoError(t, err)
	require.NoError(t, store.SaveResponseCommit(ctx, c, httpClaim("k", "").ID, res.Row, &storedResponse{Status: 201, Body: []byte("ok")}))
	require.Equal(t, byte('I'), c.PgConn().TxStatus())
	_, resp, err := store.GetResponse(ctx, pool, httpClaim("k", "").ID)
	require.NoError(t, err)
	require.Equal(t, "ok", string(resp.Body))

	// No claimed row: an error, and nothing of the transaction commits.
	_, err = c.Exec(ctx, "begin; "+txmark.Mark)
	require.NoError(t, err)
	_, err = c.Exec(ctx, `INSERT INTO work VALUES (2)`)
	require.NoError(t, err)
	err = store.SaveResponseCommit(ctx, c, httpClaim("unclaimed", "").ID, rowRef{}, &storedResponse{Status: 201})
	require.ErrorContains(t, err, "no completed inbox row")
	require.NotErrorIs(t, err, txmark.ErrCommitUnknown)
	require.Equal(t, byte('E'), c.PgConn().TxStatus(), "the transaction is failed, not committed")
	_, err = c.Exec(ctx, `rollback`)
	require.NoError(t, err)
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM work`))

	// Lease: a stale fence commits nothing.
	lres, err := store.LeaseResponse(ctx, pool, httpClaim("l", "fp"), time.Minute)
	require.NoError(t, err)
	_, err = c.Exec(ctx, "begin; "+txmark.Mark)
	require.NoError(t, err)
	_, err = c.Exec(ctx, `INSERT INTO work VALUES (3)`)
	require.NoError(t, err)
	err = store.CompleteLeaseResponseCommit(ctx, c, httpClaim("l", "").ID, lres.Fence+1, 0, &storedResponse{Status: 201})
	require.ErrorIs(t, err, inbox.ErrLeaseLost)
	_, err = c.Exec(ctx, `rollback`)
	require.NoError(t, err)
	require.NoError(t, func() error {
		_, err := c.Exec(ctx, "begin; "+txmark.Mark)
		return err
	}())
	require.NoError(t, store.CompleteLeaseResponseCommit(ctx, c, httpClaim("l", "").ID, lres.Fence, 0, &storedResponse{Status: 201}))
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM work`))
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE key = 'l' AND state = 'completed'`))
}

// TestCommitChecksTheMark: a transaction that lost idem's mark (the handler ran
// COMMIT or ROLLBACK and then BEGIN) is never committed by SaveResponseCommit,
// CompleteLeaseResponseCommit or CommitMarked: ErrTxReplaced, and the work of the
// replacement stays uncommitted. RollbackMarked tells the two apart.
func TestCommitChecksTheMark(t *testing.T) {
	store, pool := setupResponses(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE work (n int)`)
	require.NoError(t, err)
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	c := conn.Conn()
	replaced := func(end string) {
		t.Helper()
		_, err := c.Exec(ctx, end+"; BEGIN")
		require.NoError(t, err)
		_, err = c.Exec(ctx, `INSERT INTO work VALUES (1)`)
		require.NoError(t, err)
	}
	requireNothingCommitted := func(err error) {
		t.Helper()
		require.ErrorIs(t, err, txmark.ErrTxReplaced)
		require.Equal(t, "tx_replaced", inbox.Code(err))
		require.Equal(t, byte('E'), c.PgConn().TxStatus(), "the replacement is failed, not committed")
		_, err = c.Exec(ctx, `rollback`)
		require.NoError(t, err)
		require.Equal(t, 0, pgtest.Count(t, pool, `SELECT count(*) FROM work`))
	}

	res, err := store.ClaimResponseTx(ctx, c, []string{"begin"}, httpClaim("k", "fp"), time.Second)
	require.NoError(t, err)
	require.True(t, res.Claimed)
	replaced("COMMIT")
	requireNothingCommitted(store.SaveResponseCommit(ctx, c, httpClaim("k", "").ID, res.Row, &storedResponse{Status: 201}))
	// The handler's COMMIT took the claim with it, without a response: the key is
	// answered separately, once.
	answered, err := store.AnswerCommitted(ctx, pool, httpClaim("k", "fp"), 0, "handler_committed", "m", &storedResponse{Status: 500, Body: []byte("p")})
	require.NoError(t, err)
	require.True(t, answered)
	answered, err = store.AnswerCommitted(ctx, pool, httpClaim("k", "fp"), 0, "handler_committed", "m", &storedResponse{Status: 500})
	require.NoError(t, err)
	require.False(t, answered, "only a key without a response")
	rec, resp, err := store.GetResponse(ctx, pool, httpClaim("k", "").ID)
	require.NoError(t, err)
	require.Equal(t, inboxdb.StateCompleted, rec.State)
	require.Equal(t, "handler_committed", rec.ErrorCode)
	require.Equal(t, "p", string(resp.Body))

	lres, err := store.LeaseResponse(ctx, pool, httpClaim("l", "fp"), time.Minute)
	require.NoError(t, err)
	_, err = c.Exec(ctx, "begin; "+txmark.Mark)
	require.NoError(t, err)
	replaced("ROLLBACK")
	requireNothingCommitted(store.CompleteLeaseResponseCommit(ctx, c, httpClaim("l", "").ID, lres.Fence, 0, &storedResponse{Status: 201}))
	answered, err = store.AnswerCommitted(ctx, pool, httpClaim("l", "fp"), lres.Fence+1, "handler_committed", "m", &storedResponse{Status: 500})
	require.NoError(t, err)
	require.False(t, answered, "a stale fence")
	answered, err = store.AnswerCommitted(ctx, pool, httpClaim("l", "fp"), lres.Fence, "handler_committed", "m", &storedResponse{Status: 500})
	require.NoError(t, err)
	require.True(t, answered)
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE key = 'l' AND state = 'completed' AND lease_until IS NULL`))

	_, err = c.Exec(ctx, "begin; "+txmark.Mark)
	require.NoError(t, err)
	replaced("COMMIT")
	requireNothingCommitted(txmark.Commit(ctx, c))

	_, err = c.Exec(ctx, "begin; "+txmark.Mark)
	require.NoError(t, err)
	marked, err := txmark.Rollback(ctx, c)
	require.NoError(t, err)
	require.True(t, marked)
	require.Equal(t, byte('I'), c.PgConn().TxStatus())
	_, err = c.Exec(ctx, "begin; "+txmark.Mark)
	require.NoError(t, err)
	replaced("ROLLBACK")
	marked, err = txmark.Rollback(ctx, c)
	require.NoError(t, err)
	require.False(t, marked)
	require.Equal(t, byte('I'), c.PgConn().TxStatus())

	_, err = c.Exec(ctx, "begin; "+txmark.Mark)
	require.NoError(t, err)
	_, err = c.Exec(ctx, `INSERT INTO work VALUES (2)`)
	require.NoError(t, err)
	require.NoError(t, txmark.Commit(ctx, c))
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM work`))
}

// TestPreparedRoundTrips: the claim and the stored answer through the prepared
// statements (ClaimResponsePrepared, saveCommitPrepared) behave as their pgx forms
// do: the answer lands on the claimed row byte for byte and commits with the work;
// a taken key reads the existing row and its answer; no row, or a transaction
// that lost the mark, commits nothing. Each statement is prepared once per
// connection, under its own name, and the pool's query mode and tracer choose the
// path.
func TestPreparedRoundTrips(t *testing.T) {
	store, pool := setupResponses(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE work (n int)`)
	require.NoError(t, err)
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	c := conn.Conn()
	p := newPreparedStmts(store)
	answer := &storedResponse{Status: 201, headerLines: []byte("Content-Type: application/json\r\nX-Bin: \xff\x00\r\n"), Body: []byte("{\"id\":1}\x00\xff")}

	res, d, err := store.ClaimResponsePrepared(ctx, c, p, httpClaim("k", "fp"), time.Second)
	require.NoError(t, err)
	require.True(t, res.Claimed)
	require.True(t, res.Row.tid.Valid)
	require.Equal(t, byte('T'), c.PgConn().TxStatus(), "BEGIN went with the claim")
	var timeout string
	require.NoError(t, c.QueryRow(ctx, `SELECT current_setting('lock_timeout')`).Scan(&timeout))
	require.Equal(t, "1s", timeout)
	_, err = c.Exec(ctx, `INSERT INTO work VALUES (1)`)
	require.NoError(t, err)
	require.NoError(t, store.saveCommitPrepared(ctx, c, d, httpClaim("k", "").ID, res.Row, answer))
	require.Equal(t, byte('I'), c.PgConn().TxStatus())
	rec, resp, err := store.GetResponse(ctx, pool, httpClaim("k", "").ID)
	require.NoError(t, err)
	require.Equal(t, inboxdb.StateCompleted, rec.State)
	require.Equal(t, []byte("fp"), rec.Fingerprint)
	require.Equal(t, answer.Body, resp.Body)
	require.Equal(t, map[string][]string{"Content-Type": {"application/json"}, "X-Bin": {"\xff\x00"}}, resp.Header)
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM work`))
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM inbox WHERE key = 'k' AND expires_at > now() + interval '23 hours'`),
		"the retention, sent as a binary interval")

	// The key is taken: the existing row and its answer, read in the transaction.
	res, _, err = store.ClaimResponsePrepared(ctx, c, p, httpClaim("k", "other"), time.Second)
	require.NoError(t, err)
	require.False(t, res.Claimed)
	require.True(t, res.Mismatch)
	require.Equal(t, answer.Body, res.Response.Body)
	_, err = c.Exec(ctx, "rollback")
	require.NoError(t, err)

	// No claimed row at that ctid: an error, and nothing of the transaction commits.
	res, d, err = store.ClaimResponsePrepared(ctx, c, p, httpClaim("k2", "fp"), time.Second)
	require.NoError(t, err)
	_, err = c.Exec(ctx, `INSERT INTO work VALUES (2)`)
	require.NoError(t, err)
	wrong := res.Row
	wrong.tid.OffsetNumber += 100
	err = store.saveCommitPrepared(ctx, c, d, httpClaim("k2", "").ID, wrong, answer)
	require.ErrorContains(t, err, "no completed inbox row")
	require.NotErrorIs(t, err, txmark.ErrCommitUnknown)
	require.Equal(t, byte('E'), c.PgConn().TxStatus(), "the transaction is failed, not committed")
	_, err = c.Exec(ctx, "rollback")
	require.NoError(t, err)

	// The handler ended the transaction and began another: nothing of it commits.
	res, d, err = store.ClaimResponsePrepared(ctx, c, p, httpClaim("k3", "fp"), time.Second)
	require.NoError(t, err)
	_, err = c.Exec(ctx, "COMMIT; BEGIN")
	require.NoError(t, err)
	_, err = c.Exec(ctx, `INSERT INTO work VALUES (3)`)
	require.NoError(t, err)
	require.ErrorIs(t, store.saveCommitPrepared(ctx, c, d, httpClaim("k3", "").ID, res.Row, answer), txmark.ErrTxReplaced)
	_, err = c.Exec(ctx, "rollback")
	require.NoError(t, err)
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM work`))

	var names []string
	rows, err := c.Query(ctx, `SELECT name FROM pg_prepared_statements WHERE name LIKE 'idem\_%' ORDER BY name`)
	require.NoError(t, err)
	names, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Len(t, names, 4, "BEGIN, the claim, the answer, COMMIT: prepared once")

	cfg := pool.Config().ConnConfig
	require.True(t, usePrepared(cfg), "the default query mode")
	cfg.DefaultQueryExecMode = pgx.QueryExecModeExec
	require.False(t, usePrepared(cfg), "a mode that prepares nothing (PgBouncer)")
	cfg = pool.Config().ConnConfig
	cfg.Tracer = tracerFunc(nil)
	require.False(t, usePrepared(cfg), "a pgx tracer sees only what goes through pgx")
}

// tracerFunc is a pgx.QueryTracer that does nothing.
type tracerFunc func()

func (tracerFunc) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}
func (tracerFunc) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
