package effects

import (
	"strconv"

	"github.com/jackc/pgx/v5"
)

// notifyChannel is the channel the effects trigger notifies, with the schema name
// as payload.
const notifyChannel = "idem_effects"

// queries holds the Dispatcher's and requeue's statements, rendered once for one
// schema. Every value is a bind parameter; the schema is validated and quoted.
type queries struct {
	claim, record, recordAgain, notify, pending, requeue string
}

// recordSet and recordWhere are the outcome update's SET and WHERE, shared by
// record and recordAgain; d is the outcome row.
const (
	recordSet = `state = d.state,
				done_at = CASE WHEN d.state = 'done' THEN now() END,
				next_attempt_at = CASE WHEN d.state = 'pending'
					THEN now() + d.delay_ms * interval '1 millisecond' ELSE e.next_attempt_at END,
				in_flight = d.in_flight,
				attempts = e.attempts - d.undo,
				last_error = coalesce(d.err, e.last_error),
				recorded_fence = d.fence`
	recordWhere = `e.tenant = d.tenant AND e.kind = d.kind AND e.key = d.key
				AND e.fence = d.fence AND e.state = 'pending' AND e.recorded_fence <> d.fence`
)

// enqueueQueries are Enqueue's statements for one schema.
type enqueueQueries struct {
	insert, fingerprint       string
	insertMany, fingerprintOf string
}

func newEnqueueQueries(schema string) enqueueQueries {
	t := pgx.Identifier{schema, "effects"}.Sanitize()
	return enqueueQueries{
		// The due time is clock_timestamp() + delay: the database's time when this
		// statement runs, not now(), which is the start of the transaction and would
		// make a delay count from before the Enqueue call.
		insert: `INSERT INTO ` + t + ` (tenant, kind, key, payload, fingerprint, max_attempts,
				next_attempt_at, source_consumer, source_tenant, source_key)
			VALUES ($1, $2, $3, $4, $5, $6, clock_timestamp() + $7::interval, $8, $9, $10)
			ON CONFLICT (tenant, kind, key) DO NOTHING
			RETURNING true`,
		fingerprint: `SELECT fingerprint FROM ` + t + ` WHERE tenant = $1 AND kind = $2 AND key = $3`,
		// EnqueueItems: many effects in one statement, in the order given (the caller
		// sorts them by identity, so that two batches wait for each other's keys in
		// the same order and cannot deadlock). It answers with how many it inserted
		// and, only when that is not all of them, which ones, as three arrays (so
		// QueryRow is enough). The delay is in microseconds; an empty source consumer
		// means no source (consumer names are never empty).
		insertMany: `WITH ins AS (
				INSERT INTO ` + t + ` (tenant, kind, key, payload, fingerprint, max_attempts,
					next_attempt_at, source_consumer, source_tenant, source_key)
				SELECT tenant, kind, key, payload, fingerprint, max_attempts,
					clock_timestamp() + delay_us * interval '1 microsecond', nullif(source_consumer, ''),
					CASE WHEN source_consumer <> '' THEN source_tenant END,
					CASE WHEN source_consumer <> '' THEN source_key END
				FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::bytea[], $6::int[],
						$7::bigint[], $8::text[], $9::text[], $10::text[]) WITH ORDINALITY
					AS u(tenant, kind, key, payload, fingerprint, max_attempts, delay_us,
						source_consumer, source_tenant, source_key, ord)
				ORDER BY ord
				ON CONFLICT (tenant, kind, key) DO NOTHING
				RETURNING tenant, kind, key
			)
			SELECT count(*)::int,
				CASE WHEN count(*) < $11 THEN coalesce(array_agg(tenant), '{}') END,
				CASE WHEN count(*) < $11 THEN coalesce(array_agg(kind), '{}') END,
				CASE WHEN count(*) < $11 THEN coalesce(array_agg(key), '{}') END
			FROM ins`,
		// The stored fingerprints of the effects an insertMany did not insert: a new
		// statement, so at READ COMMITTED it sees rows that a concurrent transaction
		// committed while the insert waited for it. LATERAL on the primary key, kept
		// apart from the join by OFFSET 0 so that it stays one index lookup per effect
		// on a table that has never been analyzed.
		fingerprintOf: `SELECT coalesce(array_agg(e.tenant), '{}'), coalesce(array_agg(e.kind), '{}'),
				coalesce(array_agg(e.key), '{}'), coalesce(array_agg(e.fingerprint), '{}')
			FROM unnest($1::text[], $2::text[], $3::text[]) AS u(tenant, kind, key)
			CROSS JOIN LATERAL (
				SELECT tenant, kind, key, fingerprint FROM ` + t + ` e
				WHERE e.tenant = u.tenant AND e.kind = u.kind AND e.key = u.key
				OFFSET 0
			) e`,
	}
}

// newQueries renders the statements for schema. claimLimit is the most one claim can
// return (the batch size times the number of kinds); it is written into the SQL as
// a literal on purpose, see claim.
func newQueries(schema string, claimLimit int) queries {
	t := pgx.Identifier{schema, "effects"}.Sanitize()
	return queries{
		// One statement claims up to n[i] due effects of each kind[i]. SKIP LOCKED
		// lets dispatchers claim side by side without waiting on each other. The
		// claim moves next_attempt_at to the end of the lease (a visibility timeout),
		// bumps fence and attempts, and sets in_flight. It commits on its own, before
		// any send. The old in_flight tells whether the previous attempt's outcome is
		// unknown; the old next_attempt_at is when the effect became due (for lag).
		// Times are the database's now(), never the application's clock. The outer
		// LIMIT is redundant for the result but tells the planner how few rows come
		// out of the LATERAL, so it updates them through the primary key instead of
		// hashing the whole table. It is a literal, not a parameter: pgx prepares
		// statements, and after five runs Postgres may switch to a generic plan that
		// cannot see a parameter's value (and then picks the hash join and a
		// sequential scan of the whole table).
		claim: `WITH want AS (
				SELECT * FROM unnest($1::text[], $2::int[]) AS w(kind, n)
			), due AS (
				SELECT c.* FROM want CROSS JOIN LATERAL (
					SELECT e.tenant, e.kind, e.key, e.in_flight, e.next_attempt_at
					FROM ` + t + ` e
					WHERE e.state = 'pending' AND e.kind = want.kind AND e.next_attempt_at <= now()
					ORDER BY e.next_attempt_at
					LIMIT want.n
					FOR UPDATE SKIP LOCKED
				) c
				LIMIT ` + strconv.Itoa(max(claimLimit, 1)) + `
			)
			UPDATE ` + t + ` e
			SET next_attempt_at = now() + $3::interval, fence = e.fence + 1,
				attempts = e.attempts + 1, in_flight = true
			FROM due
			WHERE e.tenant = due.tenant AND e.kind = due.kind AND e.key = due.key
			RETURNING e.tenant, e.kind, e.key, e.payload, e.attempts, e.max_attempts, e.fence,
				due.in_flight, e.created_at, extract(epoch FROM now() - due.next_attempt_at)::float8,
				coalesce(e.source_consumer, ''), coalesce(e.source_tenant, ''), coalesce(e.source_key, '')`,
		// Records a batch of outcomes in one statement. Each row applies only if the
		// fence still matches: an attempt whose lease ran out and was claimed again
		// cannot overwrite the newer attempt. undo is 1 for a claim released without
		// an attempt, which gives the attempt back and restores the in_flight it
		// found. Rows are sorted by (tenant, kind, key) by the caller, so two
		// recorders cannot deadlock. The rows that come back, with their claim's
		// fence, are the ones recorded.
		//
		// A row that applies stores its claim's fence in recorded_fence, and a row
		// whose recorded_fence already holds that fence is left alone: see
		// recordAgain.
		record: `UPDATE ` + t + ` e
			SET ` + recordSet + `
			FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::text[],
					$6::bigint[], $7::bool[], $8::int[], $9::text[])
				AS d(tenant, kind, key, fence, state, delay_ms, in_flight, undo, err)
			WHERE ` + recordWhere + `
			RETURNING e.tenant, e.kind, e.key, d.fence`,
		// recordAgain is record for a retry of the same write, whose first run may
		// have committed although its COMMIT reply was lost. Rows that run recorded
		// keep their recorded_fence, so the update leaves them alone (an attempt is
		// not given back twice, a done effect stays as it was), and the second SELECT
		// reports them as recorded all the same. Both halves read the same snapshot,
		// so a row updated here is not reported twice. The first run of a write does
		// not need the second half (no row can hold its claim's fence before its
		// outcome is written), so it runs record, which costs one index probe per row
		// less.
		recordAgain: `WITH d AS (
				SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::text[],
						$6::bigint[], $7::bool[], $8::int[], $9::text[])
					AS d(tenant, kind, key, fence, state, delay_ms, in_flight, undo, err)
			), applied AS (
				UPDATE ` + t + ` e
				SET ` + recordSet + `
				FROM d
				WHERE ` + recordWhere + `
				RETURNING e.tenant, e.kind, e.key, d.fence
			)
			SELECT tenant, kind, key, fence FROM applied
			UNION ALL
			SELECT e.tenant, e.kind, e.key, d.fence FROM ` + t + ` e JOIN d
				ON e.tenant = d.tenant AND e.kind = d.kind AND e.key = d.key
			WHERE e.recorded_fence = d.fence`,
		notify:  `SELECT pg_notify('` + notifyChannel + `', $1)`,
		pending: `SELECT kind, count(*) FROM ` + t + ` WHERE state = 'pending' GROUP BY kind`,
		// Requeue notifies in the same statement, so the wake-up is delivered when the
		// requeue commits.
		requeue: `WITH r AS (
				UPDATE ` + t + `
				SET state = 'pending', attempts = 0, next_attempt_at = now(), done_at = NULL
				WHERE state = 'dead' AND ($1 = '' OR kind = $1) AND ($2 = '' OR key = $2)
					AND ($4 = '' OR tenant = $4)
				RETURNING 1
			)
			SELECT count(*), pg_notify('` + notifyChannel + `', $3) FROM r`,
	}
}
