package effects

import (
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/citusmode"
	"github.com/idemkit/idem/internal/failgroup"
)

// notifyChannel is the channel the effects trigger notifies, with the schema name
// as payload.
const notifyChannel = "idem_effects"

// queries holds the Dispatcher's and requeue's statements, rendered once for one
// schema. Every value is a bind parameter; the schema is validated and quoted.
//
// claim filters on one tenant (tenant = $4) when the Dispatcher has one
// (Config.Tenant). recordOne and recordAgainOne are record and recordAgain for a
// batch of outcomes that all belong to one tenant, $12, which they match instead
// of each row's tenant: every outcome batch of such a Dispatcher, and any other
// of one tenant's effects.
type queries struct {
	claim, record, recordAgain, notify, pending, requeue string
	recordOne, recordAgainOne                            string
}

// recordSet and recordWhere are the outcome update's SET and WHERE, shared by
// record and recordAgain; d is the outcome row (outcomes). A dead effect keeps its
// error's code, its masked text and its failure group (package failgroup), and
// when it died.
//
// recordWhere tests the state as "not finished" rather than state = 'pending', the
// same thing under the table's CHECK: that form would let the planner use
// effects_due_idx, whose predicate is state = 'pending', for the join, and on a
// table never analyzed (where a partial index built on the empty table is taken
// to hold no rows) it did, reading every pending row of the kind for each outcome:
// 200 effects/s instead of 15,000 with 100,000 pending.
var (
	recordSet = `state = d.state,
				done_at = d.done_at,
				next_attempt_at = coalesce(d.next_at, e.next_attempt_at),
				in_flight = d.in_flight,
				attempts = e.attempts - d.undo,
				last_error = coalesce(d.err, e.last_error),
				recorded_fence = d.fence,
				error_code = CASE WHEN d.state = 'dead' THEN d.code END,
				error_masked = CASE WHEN d.state = 'dead' THEN d.masked END,
				error_group = d.dead_group,
				dead_at = d.dead_at`
	// outcomes is the outcome rows of $1..$11, with the times and the failure
	// group each sets, computed here rather than in recordSet: Citus refuses a
	// function that is not IMMUTABLE (now(), and convert_to in the group) inside
	// CASE in a write, and OFFSET 0 keeps this subquery from being pulled up
	// into the UPDATE. tenant is what the group is computed with ($12 in the
	// one-tenant forms, which every row holds).
	outcomes = func(tenant string) string {
		return `SELECT u.*,
					CASE WHEN u.state = 'done' THEN now() END AS done_at,
					CASE WHEN u.state = 'pending' THEN now() + u.delay_ms * interval '1 millisecond' END AS next_at,
					CASE WHEN u.state = 'dead' THEN now() END AS dead_at,
					CASE WHEN u.state = 'dead' THEN ` + failgroup.GroupSQL("u.kind", tenant, "u.code", "u.masked") + ` END AS dead_group
				FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::text[],
						$6::bigint[], $7::bool[], $8::int[], $9::text[], $10::text[], $11::text[]) WITH ORDINALITY
					AS u(tenant, kind, key, fence, state, delay_ms, in_flight, undo, err, code, masked, i)
				OFFSET 0`
	}
	recordWhere = func(tenant string) string {
		return `e.tenant = ` + tenant + ` AND e.kind = d.kind AND e.key = d.key
				AND e.fence = d.fence AND e.state NOT IN ('done', 'dead', 'discarded') AND e.recorded_fence <> d.fence`
	}
)

// claimSettings and recordSettings are run, as SET LOCAL statements pipelined in
// the same round trip, first in the claim's and in the outcome write's
// transactions (SET LOCAL rather than set_config, so that a distributed Postgres
// passes them on with the transaction). They make the plans of those
// statements the same whatever the table's statistics say: a burst of effects
// lands in a table that was small (or new, and never analyzed) and is drained
// before autovacuum analyzes it, or while it does.
//
//   - force_generic_plan: pgx prepares statements, so Postgres may plan each run
//     afresh with its parameters (custom plans) or reuse one plan made without them
//     (generic). Always the generic plan: one plan per connection whatever the
//     batch's size, and no planning on each claim (it cost more CPU than the claim
//     of 100 rows itself saved by it). The plan is made again, under these same
//     settings, when statistics change.
//   - No JIT: the statements are short, and compiling them would cost more than
//     running them (their plans cost far below the default jit_above_cost anyway).
//   - No sequential scans, bitmap scans, hash or merge joins, or sorts: each is
//     costed so high that the planner takes it only if nothing else is possible,
//     and each statement is written so that something else is (the indexes it can
//     use, and only those, are named at each statement). Statistics taken while
//     the table was small would otherwise make the planner read every due row and
//     sort them on every claim, or hash the whole table against a few hundred
//     outcomes.
//
// The plans are in TestPlansNeedNoStatistics.
var (
	claimSettings = []string{
		"SET LOCAL plan_cache_mode = force_generic_plan", "SET LOCAL jit = off",
		"SET LOCAL enable_seqscan = off", "SET LOCAL enable_bitmapscan = off",
		"SET LOCAL enable_hashjoin = off", "SET LOCAL enable_mergejoin = off",
		"SET LOCAL enable_sort = off",
	}
	// The outcome commits without waiting for its WAL flush: see writeOutcomes.
	recordSettings = append([]string{"SET LOCAL synchronous_commit = off"}, claimSettings...)
)

// citusSettings are settings (claimSettings or recordSettings) on Citus:
// citusmode.PropagateSet first, so that they apply on the workers, where the
// statements are planned and run, and without force_generic_plan, with which
// Citus cannot plan the parameterized claim ("could not create distributed plan").
func citusSettings(settings []string) []string {
	out := []string{citusmode.PropagateSet}
	for _, s := range settings {
		if !strings.Contains(s, "plan_cache_mode") {
			out = append(out, s)
		}
	}
	return out
}

// enqueueQueries are Enqueue's statements for one schema.
//
// insertManyOne and fingerprintOfOne are insertMany and fingerprintOf for rows
// that all belong to one tenant, which they take as one more argument ($12, $4)
// and filter on (tenant = $n, for a router by tenant).
type enqueueQueries struct {
	insert, fingerprint             string
	insertMany, fingerprintOf       string
	insertManyOne, fingerprintOfOne string
}

func newEnqueueQueries(schema string) enqueueQueries {
	t := pgx.Identifier{schema, "effects"}.Sanitize()
	// wake notifies once if ins inserted a row. The statements read it in a
	// condition that always holds (an InitPlan, run once per statement, rather
	// than a join, which would cost a step per inserted row). The schema is a
	// plain lower-case identifier (pgschema.Valid), so it is safe as a literal.
	// pg_notify returns void, which Citus cannot carry out of a CTE (column
	// "pg_notify" has pseudo-type void): the cast to text lets it plan the CTE on
	// the coordinator, which sends the notification its listeners hear, and costs
	// plain Postgres nothing.
	wake := `wake AS (SELECT pg_notify('` + notifyChannel + `', '` + schema + `')::text FROM (SELECT FROM ins LIMIT 1) one)`
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
	return enqueueQueries{
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
	}
}

// groupTenant is the tenant an outcome's failure group is computed with, for the
// tenant the outcome write matches (d.tenant, or the one tenant's parameter).
func groupTenant(tenant string) string {
	if tenant == "d.tenant" {
		return "u.tenant"
	}
	return tenant
}

// newQueries renders the statements for schema. claimLimit is the most one claim can
// return (the batch size times the number of kinds); it is written into the SQL as
// a literal on purpose, see claim. oneTenant: the Dispatcher serves one tenant
// (Config.Tenant), which its claim takes as $4.
func newQueries(schema string, claimLimit int, oneTenant bool) queries {
	t := pgx.Identifier{schema, "effects"}.Sanitize()
	// onlyTenant filters the claim's scan and its update on the Dispatcher's tenant.
	var onlyTenant string
	if oneTenant {
		onlyTenant = " AND e.tenant = $4"
	}
	record := func(tenant string) string {
		return `UPDATE ` + t + ` e
			SET ` + recordSet + `
			FROM (` + outcomes(groupTenant(tenant)) + `) d
			WHERE ` + recordWhere(tenant) + `
			RETURNING d.i`
	}
	recordAgain := func(tenant string) string {
		return `WITH d AS (
				` + outcomes(groupTenant(tenant)) + `
			), applied AS (
				UPDATE ` + t + ` e
				SET ` + recordSet + `
				FROM d
				WHERE ` + recordWhere(tenant) + `
				RETURNING d.i
			)
			SELECT i FROM applied
			UNION ALL
			SELECT d.i FROM ` + t + ` e JOIN d
				ON e.tenant = ` + tenant + ` AND e.kind = d.kind AND e.key = d.key
			WHERE e.recorded_fence = d.fence`
	}
	return queries{
		// One statement claims up to n[i] due effects of each kind[i]. SKIP LOCKED
		// lets dispatchers claim side by side without waiting on each other. The
		// claim moves next_attempt_at to the end of the lease (a visibility timeout),
		// bumps fence and attempts, and sets in_flight. It commits on its own, before
		// any send. The old in_flight tells whether the previous attempt's outcome is
		// unknown; the old next_attempt_at is when the effect became due (for lag).
		// Times are the database's now(), never the application's clock.
		//
		// The plan is fixed by the statement's shape and claimSettings, not by
		// statistics (see claimSettings): per kind, a LATERAL range scan of
		// effects_due_idx (kind, next_attempt_at) in index order, which stops after
		// n rows; then the update of each row it locked, found by its ctid (a TID
		// scan: no index at all). The row's ctid cannot change while this
		// transaction holds its lock. Should the row have been updated by a
		// transaction that committed after this statement's snapshot (the lock then
		// follows it to the new version), the update does not see the new version
		// and leaves the row unclaimed: it stays due, for the next claim. The outer
		// LIMIT is redundant for the result and caps the planner's estimate of the
		// rows out of the LATERAL. The lag (how long the effect has been due) is
		// computed where the row is read, not in RETURNING, where Citus refuses
		// now().
		claim: `WITH want AS (
				SELECT * FROM unnest($1::text[], $2::int[]) AS w(kind, n)
			), due AS (
				SELECT c.* FROM want CROSS JOIN LATERAL (
					SELECT e.ctid AS row, e.in_flight, extract(epoch FROM now() - e.next_attempt_at)::float8 AS lag
					FROM ` + t + ` e
					WHERE e.state = 'pending' AND e.kind = want.kind AND e.next_attempt_at <= now()` + onlyTenant + `
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
			WHERE e.ctid = due.row` + onlyTenant + `
			RETURNING e.tenant, e.kind, e.key, e.payload, e.attempts, e.max_attempts, e.fence,
				due.in_flight, e.created_at, due.lag,
				coalesce(e.source_consumer, ''), coalesce(e.source_tenant, ''), coalesce(e.source_key, ''),
				coalesce(e.trace_context::text, '')`,
		// Records a batch of outcomes in one statement. Each row applies only if the
		// fence still matches: an attempt whose lease ran out and was claimed again
		// cannot overwrite the newer attempt. undo is 1 for a claim released without
		// an attempt, which gives the attempt back and restores the in_flight it
		// found. Rows are sorted by (tenant, kind, key) by the caller, so two
		// recorders cannot deadlock. What comes back is the ordinal (from 1) of each
		// outcome recorded.
		//
		// A row that applies stores its claim's fence in recorded_fence, and a row
		// whose recorded_fence already holds that fence is left alone: see
		// recordAgain.
		//
		// The only index this statement can use is the primary key (see recordWhere),
		// probed once per outcome in a nested loop; claimSettings rule out the rest.
		record:    record("d.tenant"),
		recordOne: record("$12"),
		// recordAgain is record for a retry of the same write, whose first run may
		// have committed although its COMMIT reply was lost. Rows that run recorded
		// keep their recorded_fence, so the update leaves them alone (an attempt is
		// not given back twice, a done effect stays as it was), and the second SELECT
		// reports them as recorded all the same. Both halves read the same snapshot,
		// so a row updated here is not reported twice. The first run of a write does
		// not need the second half (no row can hold its claim's fence before its
		// outcome is written), so it runs record, which costs one index probe per row
		// less.
		recordAgain:    recordAgain("d.tenant"),
		recordAgainOne: recordAgain("$12"),
		notify:         `SELECT pg_notify('` + notifyChannel + `', $1)`,
		pending:        `SELECT kind, count(*) FROM ` + t + ` WHERE state = 'pending' GROUP BY kind`,
		// Requeue notifies in the same statement, so the wake-up is delivered when the
		// requeue commits.
		requeue: `WITH r AS (
				UPDATE ` + t + `
				SET state = 'pending', attempts = 0, next_attempt_at = now(), done_at = NULL
				WHERE state = 'dead' AND ($1 = '' OR kind = $1) AND ($2 = '' OR key = $2)
					AND (($4 = '' AND NOT $5) OR tenant = $4)
				RETURNING 1
			)
			SELECT count(*), pg_notify('` + notifyChannel + `', $3) FROM r`,
	}
}
