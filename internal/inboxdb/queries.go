// Package inboxdb is the inbox's engine: every statement idem runs on the inbox
// table to claim and settle keys, the Store that runs them, the key, tenant and
// consumer rules and their coded errors (package inbox re-exports what a user
// types), and the encoding of the table's stored-response columns. The Store, the
// consumer's set-based batch claim, httpidem's stored responses and the janitor all
// take their SQL from here, so that a key is claimed, forgotten and expired by the
// same statements whoever asks. Every value is a bind parameter; the schema is
// validated by the caller and quoted here. It imports nothing public of idem.
package inboxdb

import (
	"github.com/idemkit/idem/internal/failgroup"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/txmark"
)

// Queries are the statements for the inbox table of one schema.
type Queries struct {
	Claim, Fail, Get     string
	ClaimBatch, GetBatch string
	// The forms of ClaimBatch, GetBatch and DeleteExpiredKeys for a batch whose
	// keys all belong to one tenant: the same statements, the same arguments and
	// one more, that tenant, which each also filters on (tenant = $n, a plain
	// equality that a router by tenant can read).
	ClaimBatchOneTenant, GetBatchOneTenant, DeleteExpiredKeysOneTenant string
	Lease, CompleteLease, FailLease, ReleaseLease                      string
	DeleteExpiredKey, DeleteExpiredKeys                                string
	DeleteExpired                                                      string
	// DeleteExpiredByKey is DeleteExpired on Citus (citusmode), which refuses
	// FOR UPDATE across shards: see New.
	DeleteExpiredByKey string

	// The stored HTTP responses (httpidem).
	ClaimReturningRow, ClaimMarkedReturningRow            string
	GetResponse, SaveResponse, FailResponse               string
	CompleteLeaseResponse, FailLeaseResponse              string
	SaveResponseOrFail, CompleteLeaseResponseOrFail       string
	AnswerCommittedResponse, AnswerCommittedLeaseResponse string
}

// New renders the statements for schema, which the caller has validated.
func New(schema string) Queries {
	t := pgschema.Table(schema, "inbox")
	// group is the failure group's ID of a failed row (package failgroup), from
	// its consumer, tenant, code and masked error text.
	group := failgroup.GroupSQL
	// probe reads the rows of the keys in $1, $2, $3 (consumers, tenants, keys),
	// one primary-key lookup each (see ClaimBatch), with the place of each key in
	// the arrays (from 1), as ClaimBatch's rows.
	probe := func(tenant string) string {
		return `SELECT u.ord::int, i.fingerprint, i.state, i.error_code, i.error, i.attempts,
			i.lease_until, i.fence, i.received_at, i.completed_at, i.expires_at, now()
		FROM unnest($1::text[], $2::text[], $3::text[]) WITH ORDINALITY AS u(consumer, tenant, key, ord)
		CROSS JOIN LATERAL (
			SELECT * FROM ` + t + ` i
			WHERE i.consumer = u.consumer AND i.tenant = ` + tenant + ` AND i.key = u.key
			OFFSET 0
		) i`
	}
	// claimBatch renders ClaimBatch: where is a filter on the keys to insert (none
	// in the mixed form), tenant what the probe's tenant equals.
	claimBatch := func(where, tenant string) string {
		return `WITH ins AS (
				INSERT INTO ` + t + ` (consumer, tenant, key, fingerprint, state, completed_at, expires_at, error_code, error,
					error_masked, error_group)
				SELECT consumer, tenant, key, fingerprint,
					CASE WHEN failed THEN 'failed' ELSE 'completed' END, now(),
					now() + retention_us * interval '1 microsecond',
					CASE WHEN failed THEN error_code END, CASE WHEN failed THEN error END,
					CASE WHEN failed THEN masked END,
					CASE WHEN failed THEN ` + group("consumer", "tenant", "error_code", "masked") + ` END
				FROM (SELECT unnest($1::text[]) AS consumer, unnest($2::text[]) AS tenant, unnest($3::text[]) AS key,
						unnest($4::bytea[]) AS fingerprint, unnest($5::bool[]) AS failed,
						unnest($6::text[]) AS error_code, unnest($7::text[]) AS error,
						unnest($8::bigint[]) AS retention_us, unnest($9::text[]) AS masked) u` + where + `
				ON CONFLICT (consumer, tenant, key) DO NOTHING
				RETURNING consumer, tenant, key
			)
			SELECT k.ord::int, i.fingerprint, i.state, i.error_code, i.error, i.attempts,
				i.lease_until, i.fence, i.received_at, i.completed_at, i.expires_at, now()
			FROM (
				SELECT u.*, (u.consumer, u.tenant, u.key) IN (SELECT consumer, tenant, key FROM ins) AS claimed
				FROM (SELECT unnest($1::text[]) AS consumer, unnest($2::text[]) AS tenant, unnest($3::text[]) AS key,
						generate_subscripts($1::text[], 1) AS ord) u
				OFFSET 0
			) k
			LEFT JOIN LATERAL (
				SELECT * FROM ` + t + ` i
				WHERE i.consumer = k.consumer AND i.tenant = ` + tenant + ` AND i.key = k.key
				OFFSET 0
			) i ON true
			WHERE NOT k.claimed`
	}
	deleteExpiredKeys := func(tenant string) string {
		return `DELETE FROM ` + t + ` i
			USING unnest($1::text[], $2::text[], $3::text[]) AS u(consumer, tenant, key)
			WHERE i.consumer = u.consumer AND i.tenant = ` + tenant + ` AND i.key = u.key
				AND i.state IN ('completed', 'failed') AND i.expires_at < now()`
	}
	return Queries{
		// Times come from the database (now()), never the application's clock.
		Claim: `INSERT INTO ` + t + ` (consumer, tenant, key, fingerprint, state, completed_at, expires_at)
			VALUES ($1, $2, $3, $4, 'completed', now(), now() + $5::interval)
			ON CONFLICT (consumer, tenant, key) DO NOTHING
			RETURNING true`,
		// A failure keeps its masked error text ($8, failgroup.Mask) and its group.
		Fail: `INSERT INTO ` + t + ` (consumer, tenant, key, fingerprint, state, completed_at, expires_at, error_code, error,
				error_masked, error_group)
			VALUES ($1, $2, $3, $4, 'failed', now(), now() + $5::interval, $6, $7, $8, ` + group("$1", "$2", "$6", "$8") + `)
			ON CONFLICT (consumer, tenant, key) DO NOTHING
			RETURNING true`,
		Get: `SELECT consumer, tenant, key, fingerprint, state, error_code, error, attempts,
				lease_until, fence, received_at, completed_at, expires_at, now()
			FROM ` + t + ` WHERE consumer = $1 AND tenant = $2 AND key = $3`,
		// The set-based claim of a group-commit batch (the consumer's). The keys
		// come sorted, and the INSERT takes them in that order, and so the row locks
		// and the waits for concurrent claimers: two batches that share keys cannot
		// deadlock. The arrays are unnested in a select list, which yields their
		// elements row by row, in order and in step (unnest in FROM would first copy
		// every row into a tuplestore), with nothing between it and the INSERT that
		// could reorder them; NULL arrays (failed, error_code, error and masked: no
		// failure to record) pad with NULLs.
		//
		// It answers with a row for each key it did not insert, and none for the
		// keys it claimed, which are most of them: ord (the key's place in the
		// arrays, from 1) and, when the statement's snapshot sees the key's row (one
		// committed before it began, such as the original of a redelivered message),
		// that row; NULLs when it sees none (a concurrent claimer committed the row
		// while this INSERT waited for it: GetBatch reads those afterwards). Whether
		// a key was inserted is a lookup in a hash of the INSERT's own rows (the
		// hashed subplan of IN), so the primary key is probed only for the keys
		// that were not: the probe of a key inserted by the same statement would
		// find its index entry and then read an invisible row. The probe is a
		// LATERAL subquery on the primary key, one index lookup per key whatever
		// the statistics say: OFFSET 0 keeps the planner from flattening it into a
		// join, which it plans (and pgx's prepared statement caches) as a hash join
		// over a sequential scan of the whole inbox while the table is new and not
		// yet analyzed (TestClaimBatchPlanNeedsNoStatistics). Times are the
		// database's; retention is in microseconds.
		//
		// The one-tenant form inserts only the keys of its tenant ($10), which are
		// all of them (a filter, which reorders nothing), and probes that tenant's
		// rows.
		ClaimBatch:          claimBatch("", "k.tenant"),
		ClaimBatchOneTenant: claimBatch("\n\t\t\t\tWHERE u.tenant = $10", "$10"),
		GetBatch:            probe("u.tenant"),
		GetBatchOneTenant:   probe("$4"),
		// A processing row whose lease ran out is taken over in the same statement,
		// fence + 1, so two deliveries can never both believe they hold the key. The
		// fingerprint must match: a different command never takes over a key.
		// The lease ran out when it ends before the transaction's now(), which the
		// proposed row carries as received_at (its default): Citus refuses a
		// function that is not IMMUTABLE in ON CONFLICT's WHERE, and this reads the
		// same value without one.
		Lease: `INSERT INTO ` + t + ` AS i (consumer, tenant, key, fingerprint, state, lease_until, fence, expires_at)
			VALUES ($1, $2, $3, $4, 'processing', now() + $6::interval, 1, now() + $5::interval)
			ON CONFLICT (consumer, tenant, key) DO UPDATE
				SET fence = i.fence + 1, lease_until = EXCLUDED.lease_until, attempts = i.attempts + 1
				WHERE i.state = 'processing' AND i.lease_until < EXCLUDED.received_at AND i.fingerprint = EXCLUDED.fingerprint
			RETURNING fence`,
		CompleteLease: `UPDATE ` + t + ` SET state = 'completed', completed_at = now(), lease_until = NULL,
				expires_at = now() + $5::interval
			WHERE consumer = $1 AND tenant = $2 AND key = $3 AND fence = $4 AND state = 'processing'`,
		FailLease: `UPDATE ` + t + ` SET state = 'failed', completed_at = now(), lease_until = NULL,
				expires_at = now() + $5::interval, error_code = $6, error = $7,
				error_masked = $8, error_group = ` + group("consumer", "tenant", "$6", "$8") + `
			WHERE consumer = $1 AND tenant = $2 AND key = $3 AND fence = $4 AND state = 'processing'`,
		ReleaseLease: `UPDATE ` + t + ` SET lease_until = now()
			WHERE consumer = $1 AND tenant = $2 AND key = $3 AND fence = $4 AND state = 'processing'`,
		// A claim that meets a settled row past its expiry deletes it and claims the
		// key again (the Store, the consumer's batch claim, httpidem): a key past its
		// retention is forgotten whether or not the janitor has come by. Only such a row goes; a processing
		// row never does. A row that a concurrent claimer deletes first makes this
		// delete wait for it, then find nothing: the claim that follows meets that
		// claimer's row.
		DeleteExpiredKey: `DELETE FROM ` + t + `
			WHERE consumer = $1 AND tenant = $2 AND key = $3
				AND state IN ('completed', 'failed') AND expires_at < now()`,
		DeleteExpiredKeys:          deleteExpiredKeys("u.tenant"),
		DeleteExpiredKeysOneTenant: deleteExpiredKeys("$4"),
		// The janitor's delete picks a batch in expiry order through the partial
		// index inbox_expires_at_idx, so no batch rescans the rows that earlier
		// batches left dead, and deletes by ctid, which the row lock of the same
		// statement pins. SKIP LOCKED: a row someone holds is left for the next
		// pass rather than waited for. The state filter keeps processing rows out,
		// always.
		DeleteExpired: `DELETE FROM ` + t + ` WHERE ctid = ANY (ARRAY(
				SELECT ctid FROM ` + t + `
				WHERE state IN ('completed', 'failed') AND expires_at < now()
				ORDER BY expires_at
				LIMIT $1
				FOR UPDATE SKIP LOCKED))
			AND state IN ('completed', 'failed')`,
		// DeleteExpired on Citus, where the inbox is spread over shards: a row
		// lock across shards (FOR UPDATE) and the ctid of another shard's row mean
		// nothing there. The batch is picked the same way, and deleted by primary
		// key; Citus runs the pick first, on every shard, then the delete of what
		// it found. A row someone holds is waited for, not skipped.
		DeleteExpiredByKey: `DELETE FROM ` + t + ` WHERE (consumer, tenant, key) IN (
				SELECT consumer, tenant, key FROM ` + t + `
				WHERE state IN ('completed', 'failed') AND expires_at < now()
				ORDER BY expires_at
				LIMIT $1)
			AND state IN ('completed', 'failed') AND expires_at < now()`,
		// The stored HTTP responses (httpidem). The claim returns where its row
		// went (the ctid), for SaveResponseOrFail to find it without an index lookup.
		ClaimReturningRow: `INSERT INTO ` + t + ` (consumer, tenant, key, fingerprint, state, completed_at, expires_at)
			VALUES ($1, $2, $3, $4, 'completed', now(), now() + $5::interval)
			ON CONFLICT (consumer, tenant, key) DO NOTHING
			RETURNING ctid`,
		// The first claim of a request's transaction: ClaimReturningRow that also
		// sets the transaction's lock_timeout ($6, in ms) and txmark.Mark, one
		// statement where two cost each side a statement's work more. The settings
		// come from the one row the INSERT reads, so they are in force before it can
		// wait for a concurrent claimer of the key; set_config is volatile, so the
		// planner neither drops nor pulls up that subquery.
		ClaimMarkedReturningRow: `INSERT INTO ` + t + ` (consumer, tenant, key, fingerprint, state, completed_at, expires_at)
			SELECT $1::text, $2::text, $3::text, $4::bytea, 'completed', now(), now() + $5::interval
			FROM (SELECT set_config('lock_timeout', $6::text, true), set_config('idem.tx', 'on', true)) AS settings
			ON CONFLICT (consumer, tenant, key) DO NOTHING
			RETURNING ctid`,
		GetResponse: `SELECT consumer, tenant, key, fingerprint, state, error_code, error, attempts,
				lease_until, fence, received_at, completed_at, expires_at, now(),
				response_status, response_headers, response_body, response_ref
			FROM ` + t + ` WHERE consumer = $1 AND tenant = $2 AND key = $3`,
		SaveResponse: `UPDATE ` + t + ` SET response_status = $4, response_headers = $5, response_body = $6, response_ref = $7
			WHERE consumer = $1 AND tenant = $2 AND key = $3 AND state = 'completed'`,
		FailResponse: `INSERT INTO ` + t + ` (consumer, tenant, key, fingerprint, state, completed_at, expires_at, error_code, error,
				response_status, response_headers, response_body, response_ref, error_masked, error_group)
			VALUES ($1, $2, $3, $4, 'failed', now(), now() + $5::interval, $6, $7, $8, $9, $10, $11,
				$12, ` + group("$1", "$2", "$6", "$12") + `)
			ON CONFLICT (consumer, tenant, key) DO NOTHING
			RETURNING true`,
		CompleteLeaseResponse: `UPDATE ` + t + ` SET state = 'completed', completed_at = now(), lease_until = NULL,
				expires_at = now() + $5::interval,
				response_status = $6, response_headers = $7, response_body = $8, response_ref = $9
			WHERE consumer = $1 AND tenant = $2 AND key = $3 AND fence = $4 AND state = 'processing'`,
		FailLeaseResponse: `UPDATE ` + t + ` SET state = 'failed', completed_at = now(), lease_until = NULL,
				expires_at = now() + $5::interval, error_code = $6, error = $7,
				response_status = $8, response_headers = $9, response_body = $10, response_ref = $11,
				error_masked = $12, error_group = ` + group("consumer", "tenant", "$6", "$12") + `
			WHERE consumer = $1 AND tenant = $2 AND key = $3 AND fence = $4 AND state = 'processing'`,
		// The "OrFail" forms go to the server in one round trip with COMMIT: an
		// update that matched no row, or a transaction without idem's mark (the
		// handler ended idem's transaction and began another), must stop that
		// COMMIT, so they fail the statement, which leaves the transaction failed
		// and the COMMIT unexecuted: division by zero for no row, and txmark's guard
		// for no mark. An update never runs in a transaction without the mark.
		SaveResponseOrFail: `WITH saved AS (UPDATE ` + t + ` SET response_status = $5, response_headers = $6, response_body = $7, response_ref = $8
				WHERE ctid = $4 AND consumer = $1 AND tenant = $2 AND key = $3 AND state = 'completed'
					AND ` + txmark.Marked + ` RETURNING 1)
			SELECT ` + txmark.Guard + `(1 / count(*))::text` + txmark.GuardEnd + ` FROM saved`,
		CompleteLeaseResponseOrFail: `WITH saved AS (UPDATE ` + t + ` SET state = 'completed', completed_at = now(), lease_until = NULL,
				expires_at = now() + $5::interval,
				response_status = $6, response_headers = $7, response_body = $8, response_ref = $9
				WHERE consumer = $1 AND tenant = $2 AND key = $3 AND fence = $4 AND state = 'processing'
					AND ` + txmark.Marked + ` RETURNING 1)
			SELECT ` + txmark.Guard + `(1 / count(*))::text` + txmark.GuardEnd + ` FROM saved`,
		// A claim that committed without its response (the handler ran its own
		// COMMIT): completed, no response yet, the same request.
		AnswerCommittedResponse: `UPDATE ` + t + ` SET error_code = $5, error = $6,
				response_status = $7, response_headers = $8, response_body = $9, response_ref = $10
			WHERE consumer = $1 AND tenant = $2 AND key = $3 AND fingerprint = $4
				AND state = 'completed' AND response_status IS NULL`,
		AnswerCommittedLeaseResponse: `UPDATE ` + t + ` SET state = 'completed', completed_at = now(), lease_until = NULL,
				expires_at = now() + $5::interval, error_code = $6, error = $7,
				response_status = $8, response_headers = $9, response_body = $10, response_ref = $11
			WHERE consumer = $1 AND tenant = $2 AND key = $3 AND fence = $4 AND state = 'processing'`,
	}
}
