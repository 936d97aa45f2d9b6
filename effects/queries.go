package effects

import (
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/citusmode"
	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/failgroup"
)

// queries holds the Dispatcher's statements, rendered once for one
// schema. Every value is a bind parameter; the schema is validated and quoted.
//
// claim filters on one tenant (tenant = $4) when the Dispatcher has one
// (Config.Tenant); claimCitus is the one-tenant claim on a schema distributed by
// Citus, which a Dispatcher without a Tenant runs for each tenant that
// dueTenantsSQL finds. recordOne and recordAgainOne are record and recordAgain for a
// batch of outcomes that all belong to one tenant, $12, which they match instead
// of each row's tenant: every outcome batch of such a Dispatcher, and any other
// of one tenant's effects.
type queries struct {
	claim, claimCitus, record, recordAgain, notify, pending string
	recordOne, recordAgainOne                               string
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
	// onlyTenant filters the claim's scan on the Dispatcher's tenant; the scan
	// returns each claimed row's tenant (claimedTenant), and the update keeps to
	// rows of that tenant (sameTenant).
	const onlyTenant, claimedTenant, sameTenant = " AND e.tenant = $4", ", e.tenant", " AND e.tenant = due.tenant"
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
	claim := func(oneTenant bool, tenantOfRow string) string {
		onlyTenant, claimedTenant := onlyTenant, claimedTenant
		if !oneTenant {
			onlyTenant, claimedTenant = "", ""
		}
		return `WITH want AS (
				SELECT * FROM unnest($1::text[], $2::int[]) AS w(kind, n)
			), due AS (
				SELECT c.* FROM want CROSS JOIN LATERAL (
					SELECT e.ctid AS row, e.in_flight, extract(epoch FROM now() - e.next_attempt_at)::float8 AS lag` + claimedTenant + `
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
			WHERE e.ctid = due.row` + tenantOfRow + `
			RETURNING e.tenant, e.kind, e.key, e.payload, e.attempts, e.max_attempts, e.fence,
				due.in_flight, e.created_at, due.lag,
				coalesce(e.source_consumer, ''), coalesce(e.source_tenant, ''), coalesce(e.source_key, ''),
				coalesce(e.trace_context::text, '')`
	}
	claimPlain := func() string {
		if oneTenant {
			return claim(true, sameTenant)
		}
		return claim(false, "")
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
		// rows out of the LATERAL. A one-tenant claim's update compares each row's
		// tenant with the tenant of the row it claimed (due.tenant), not with $4:
		// given the constant, a custom plan (simple protocol, exec mode) whose
		// statistics say the tenant has no effects (a new tenant's first burst)
		// found it cheaper to read all the tenant's rows through the primary key
		// and match each against every claimed ctid. The lag (how long the effect has
		// been due) is computed where the row is read, not in RETURNING, where Citus
		// refuses now().
		claim: claimPlain(),
		// claimCitus is claim on Citus: the update names the tenant, $4, too, for
		// Citus to route the whole statement to the tenant's shard, which it
		// cannot tell from due.tenant ("cannot perform distributed planning for
		// the given modification").
		claimCitus: claim(true, sameTenant+onlyTenant),
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
		notify:         `SELECT pg_notify('` + effectsdb.NotifyChannel + `', $1)`,
		pending:        `SELECT kind, count(*) FROM ` + t + ` WHERE state = 'pending' GROUP BY kind`,
	}
}

// dueTenantsSQL renders, for a Dispatcher of kinds kinds, the read that finds on
// Citus the tenants with due effects: for each kind i, the tenants of its $2[i]
// oldest due effects of kind $1[i] ($2[i] = 0 for a kind without room). Each
// part is an ordered range scan of effects_due_idx (kind, next_attempt_at) that
// Citus runs on every shard, stopping after $2[i] rows, and merges on the
// coordinator, so the oldest due effects of all tenants come first and a tenant
// with a backlog cannot starve the others. No lock (Citus refuses FOR UPDATE
// across shards) and no DISTINCT (it would read every due row): the caller drops
// repeated tenants and claims each with claimCitus, routed to the tenant's shard.
// A tenant with nothing due costs nothing.
func dueTenantsSQL(schema string, kinds int) string {
	t := pgx.Identifier{schema, "effects"}.Sanitize()
	parts := make([]string, max(kinds, 1))
	for i := range parts {
		n := strconv.Itoa(i + 1)
		parts[i] = `(SELECT e.tenant FROM ` + t + ` e
			WHERE e.state = 'pending' AND e.kind = ($1::text[])[` + n + `] AND e.next_attempt_at <= now()
			ORDER BY e.next_attempt_at
			LIMIT ($2::int[])[` + n + `])`
	}
	return strings.Join(parts, "\n\t\tUNION ALL ")
}

// dueTenantsEachShardSQL is the Citus Dispatcher's read of due tenants when
// dueTenantsSQL fails, as it does while a worker is down: it runs on each shard
// of effects apart (Citus's run_command_on_shards, which answers a shard it
// cannot reach with success false instead of failing the read), and names, per
// shard, the tenants of its $3 oldest due effects of the kinds $2, as a JSON
// array. The shards of the workers that answer are read; the others are left for
// the next round. The command is one text, so the kinds are quoted into it
// (format's %L) on the server.
func dueTenantsEachShardSQL(schema string) string {
	return `SELECT result FROM run_command_on_shards($1::regclass, format(
		'SELECT coalesce(json_agg(DISTINCT tenant), ''[]'') FROM (SELECT tenant FROM %%s
			WHERE state = ''pending'' AND kind = ANY(%L::text[]) AND next_attempt_at <= now()
			ORDER BY next_attempt_at LIMIT %s) due', $2::text[], $3::int))
	WHERE success`
}
