package effectsdb

import (
	"strconv"

	"github.com/jackc/pgx/v5"
)

// NotifyChannel is the channel an insert or a requeue notifies, with the schema
// name as payload; the Dispatcher listens on it.
const NotifyChannel = "idem_effects"

// queries are the enqueue and requeue statements for one schema.
//
// insertManyOne and fingerprintOfOne are insertMany and fingerprintOf for rows
// that all belong to one tenant, which they take as one more argument ($12, $4)
// and filter on (tenant = $n, for a router by tenant).
//
// insertRouted and notify are insert in two statements, for Citus (Scope.Citus):
// the row alone, which Citus routes to the tenant's worker as it is, then the
// notification, on the coordinator, when the row went in. Citus runs insert's
// CTE through its recursive planner, pulling the insert's result to the
// coordinator for the notification: about a third of the speed of the two.
type queries struct {
	insert, fingerprint             string
	insertRouted, notify            string
	insertMany, fingerprintOf       string
	insertManyOne, fingerprintOfOne string
	requeue                         string
}

func newQueries(schema string) queries {
	t := pgx.Identifier{schema, "effects"}.Sanitize()
	// wake notifies once if ins inserted a row. The statements read it in a
	// condition that always holds (an InitPlan, run once per statement, rather
	// than a join, which would cost a step per inserted row). The schema is a
	// plain lower-case identifier (pgschema.Valid), so it is safe as a literal.
	// pg_notify returns void, which Citus cannot carry out of a CTE (column
	// "pg_notify" has pseudo-type void): the cast to text lets it plan the CTE on
	// the coordinator, which sends the notification its listeners hear, and costs
	// plain Postgres nothing.
	wake := `wake AS (SELECT pg_notify('` + NotifyChannel + `', '` + schema + `')::text FROM (SELECT FROM ins LIMIT 1) one)`
	insertMany := func(where string) string {
		return `WITH ins AS (
				INSERT INTO ` + t + ` (tenant, kind, key, payload, fingerprint, max_attempts,
					next_attempt_at, source_consumer, source_tenant, source_key, trace_context)
				SELECT tenant, kind, key, payload, fingerprint, coalesce(max_attempts, ` + strconv.Itoa(DefaultMaxAttempts) + `),
					clock_timestamp() + coalesce(delay_us, 0) * interval '1 microsecond', nullif(source_consumer, ''),
					CASE WHEN source_consumer <> '' THEN tenant END,
					CASE WHEN source_consumer <> '' THEN source_key END,
					nullif(trace_context, '')::jsonb
				FROM (SELECT unnest($1::text[]) AS tenant, unnest($2::text[]) AS kind, unnest($3::text[]) AS key,
						unnest($4::bytea[]) AS payload, unnest($5::bytea[]) AS fingerprint,
						unnest($6::int[]) AS max_attempts, unnest($7::bigint[]) AS delay_us,
						unnest($8::text[]) AS source_consumer, unnest($9::text[]) AS source_key,
						unnest($11::text[]) AS trace_context) u` + where + `
				ON CONFLICT (tenant, kind, key) DO NOTHING
				RETURNING tenant, kind, key
			), ` + wake + `
			SELECT count(*)::int,
				CASE WHEN count(*) < $10 THEN coalesce(array_agg(tenant), '{}') END,
				CASE WHEN count(*) < $10 THEN coalesce(array_agg(kind), '{}') END,
				CASE WHEN count(*) < $10 THEN coalesce(array_agg(key), '{}') END
			FROM ins HAVING (SELECT true FROM wake) IS NOT FALSE`
	}
	fingerprintOf := func(tenant string) string {
		return `SELECT coalesce(array_agg(e.tenant), '{}'), coalesce(array_agg(e.kind), '{}'),
				coalesce(array_agg(e.key), '{}'), coalesce(array_agg(e.fingerprint), '{}')
			FROM unnest($1::text[], $2::text[], $3::text[]) AS u(tenant, kind, key)
			CROSS JOIN LATERAL (
				SELECT tenant, kind, key, fingerprint FROM ` + t + ` e
				WHERE e.tenant = ` + tenant + ` AND e.kind = u.kind AND e.key = u.key
				OFFSET 0
			) e`
	}
	return queries{
		// The due time is clock_timestamp() + delay: the database's time when this
		// statement runs, not now(), which is the start of the transaction and would
		// make a delay count from before the Enqueue call.
		//
		// An insert wakes the dispatchers itself (wake): NOTIFY is delivered at
		// commit, and Postgres folds identical notifications of one transaction
		// into one, so a transaction of many inserts costs one. The payload is the
		// schema, so one channel serves every schema of a database. A duplicate
		// inserts nothing and notifies nothing.
		insert: `WITH ins AS (
				INSERT INTO ` + t + ` (tenant, kind, key, payload, fingerprint, max_attempts,
					next_attempt_at, source_consumer, source_tenant, source_key, trace_context)
				VALUES ($1, $2, $3, $4, $5, $6, clock_timestamp() + $7::interval, $8, $9, $10,
					nullif($11::text, '')::jsonb)
				ON CONFLICT (tenant, kind, key) DO NOTHING
				RETURNING true AS ok
			), ` + wake + `
			SELECT ok FROM ins WHERE (SELECT true FROM wake) IS NOT FALSE`,
		fingerprint: `SELECT fingerprint FROM ` + t + ` WHERE tenant = $1 AND kind = $2 AND key = $3`,
		insertRouted: `INSERT INTO ` + t + ` (tenant, kind, key, payload, fingerprint, max_attempts,
				next_attempt_at, source_consumer, source_tenant, source_key, trace_context)
			VALUES ($1, $2, $3, $4, $5, $6, clock_timestamp() + $7::interval, $8, $9, $10,
				nullif($11::text, '')::jsonb)
			ON CONFLICT (tenant, kind, key) DO NOTHING
			RETURNING true`,
		notify: `SELECT pg_notify('` + NotifyChannel + `', '` + schema + `')`,
		// EnqueueItems: many effects in one statement, in the order given (the caller
		// sorts them by identity, so that two batches wait for each other's keys in
		// the same order and cannot deadlock). It answers with how many it inserted
		// and, only when that is not all of them, which ones, as three arrays (so
		// QueryRow is enough). The arrays are unnested in the select list, which
		// yields their elements in order and in step, row by row: unnest in FROM
		// would first copy every row into a tuplestore. The delay is in microseconds;
		// an empty source consumer means no source (consumer names are never empty),
		// and the source's tenant is the effect's own. max_attempts, delay_us and
		// trace_context may be NULL arrays (every effect has the default): the
		// select list pads a shorter set with NULLs, which stand for the default.
		insertMany:    insertMany(""),
		insertManyOne: insertMany("\n\t\t\t\tWHERE u.tenant = $12"),
		// The stored fingerprints of the effects an insertMany did not insert: a new
		// statement, so at READ COMMITTED it sees rows that a concurrent transaction
		// committed while the insert waited for it. LATERAL on the primary key, kept
		// apart from the join by OFFSET 0 so that it stays one index lookup per effect
		// on a table that has never been analyzed.
		fingerprintOf:    fingerprintOf("u.tenant"),
		fingerprintOfOne: fingerprintOf("$4"),
		// Requeue notifies in the same statement, so the wake-up is delivered when the
		// requeue commits.
		requeue: `WITH r AS (
				UPDATE ` + t + `
				SET state = 'pending', attempts = 0, next_attempt_at = now(), done_at = NULL
				WHERE state = 'dead' AND ($1 = '' OR kind = $1) AND ($2 = '' OR key = $2)
					AND (($4 = '' AND NOT $5) OR tenant = $4)
				RETURNING 1
			)
			SELECT count(*), pg_notify('` + NotifyChannel + `', $3) FROM r`,
	}
}
