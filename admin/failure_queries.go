package admin

import "github.com/idemkit/idem/internal/failgroup"

// failureQueries renders the statements of the failure groups.
//
// The groups are GROUP BYs over the two partial indexes of migration 006,
// inbox_failure_group_idx (error_group, consumer, tenant, completed_at) WHERE state =
// 'failed' and effects_failure_group_idx (error_group, kind, tenant, dead_at)
// INCLUDE (attempts) WHERE state = 'dead': an index-only scan in group order feeds
// the aggregate, with no sort and no heap access once the visibility map is set, so
// the cost grows with the failed rows only, never with the completed keys or the
// done effects. One group's rows, for its samples, a show or an action, are one
// range of the same index.
func failureQueries(q *queries, inbox, effects, actions string) {
	// agg is the groups of one source whose rows pass where; the time column is
	// when a row failed.
	agg := func(source, table, alias, place, at, state, where string) string {
		return `SELECT '` + source + `' AS source, ` + alias + `.error_group AS grp, ` + alias + `.` + place + ` AS place,
				` + alias + `.tenant, count(*) AS n, min(` + alias + `.` + at + `) AS first_seen, max(` + alias + `.` + at + `) AS last_seen
			FROM ` + table + ` ` + alias + `
			WHERE ` + alias + `.state = '` + state + `' AND ` + alias + `.error_group IS NOT NULL AND ` + where + `
			GROUP BY ` + alias + `.error_group, ` + alias + `.` + place + `, ` + alias + `.tenant`
	}
	between := func(col, since, until string) string {
		return `(` + since + `::timestamptz IS NULL OR ` + col + ` >= ` + since + `) AND (` + until + `::timestamptz IS NULL OR ` + col + ` < ` + until + `)`
	}
	// sampled is the samples of one group, named by the SQL expressions source,
	// grp, place and tenant: its code, masked text, newest full error and newest n
	// keys, by one backward range scan of the group's index.
	sampled := func(source, grp, place, tenant, since, until, n string) string {
		one := func(src, table, alias, col, at, state, errCol string) string {
			return `(SELECT ` + alias + `.error_code AS code, ` + alias + `.error_masked AS masked, ` + alias + `.` + errCol + ` AS err,
					` + alias + `.key, ` + alias + `.` + at + ` AS at
				FROM ` + table + ` ` + alias + `
				WHERE ` + source + ` = '` + src + `' AND ` + alias + `.error_group = ` + grp + `
					AND ` + alias + `.` + col + ` = ` + place + ` AND ` + alias + `.tenant = ` + tenant + `
					AND ` + alias + `.state = '` + state + `' AND ` + between(alias+"."+at, since, until) + `
				ORDER BY ` + alias + `.` + at + ` DESC LIMIT ` + n + `)`
		}
		return `SELECT (array_agg(x.code ORDER BY x.at DESC))[1] AS code, (array_agg(x.masked ORDER BY x.at DESC))[1] AS masked,
					(array_agg(x.err ORDER BY x.at DESC))[1] AS example, array_agg(x.key ORDER BY x.at DESC) AS keys
				FROM (` + one(SourceInbox, inbox, "i", "consumer", "completed_at", "failed", "error") + `
					UNION ALL ` + one(SourceEffects, effects, "e", "kind", "dead_at", "dead", "last_error") + `) x`
	}
	// samples is sampled as a LATERAL over g, one group.
	samples := func(g, since, until, n string) string {
		return `CROSS JOIN LATERAL (
				` + sampled(g+".source", g+".grp", g+".place", g+".tenant", since, until, n) + `
			) s`
	}
	cols := func(g string) string {
		return g + `.source, ` + g + `.grp, ` + g + `.place, ` + g + `.tenant, ` + g + `.n, ` + g + `.first_seen, ` + g + `.last_seen,
			coalesce(s.code, ''), coalesce(s.masked, ''), coalesce(s.example, ''), s.keys`
	}
	// groups is the groups of the list's filter, aggregated: $1, $2 list inbox,
	// effects groups; $3 consumer, $4 kind, $5 tenant, $6 and $7 the time range.
	groups := `WITH g AS (
				` + agg(SourceInbox, inbox, "i", "consumer", "completed_at", "failed",
		`$1 AND ($3 = '' OR i.consumer = $3) AND ($5::text IS NULL OR i.tenant = $5) AND `+between("i.completed_at", "$6", "$7")) + `
				UNION ALL
				` + agg(SourceEffects, effects, "e", "kind", "dead_at", "dead",
		`$2 AND ($4 = '' OR e.kind = $4) AND ($5::text IS NULL OR e.tenant = $5) AND `+between("e.dead_at", "$6", "$7")) + `
			)`
	// ofCode keeps the groups g of the error code in param ('' for any).
	//
	// The code is part of the group's hash, so every row of a group has the same
	// code, and the code filter reads it from one row of each group (one probe of
	// the group's index range and one heap fetch) after the aggregate: the
	// aggregate stays an index-only scan, and the cost of the filter grows with the
	// groups, not the failures. Without a code the CASE reads nothing.
	ofCode := func(param string) string {
		return `CASE WHEN ` + param + ` = '' THEN true
					WHEN g.source = '` + SourceInbox + `' THEN (SELECT coalesce(i.error_code, '') = ` + param + ` FROM ` + inbox + ` i
						WHERE i.error_group = g.grp AND i.consumer = g.place AND i.tenant = g.tenant AND i.state = 'failed' LIMIT 1)
					ELSE (SELECT coalesce(e.error_code, '') = ` + param + ` FROM ` + effects + ` e
						WHERE e.error_group = g.grp AND e.kind = g.place AND e.tenant = g.tenant AND e.state = 'dead' LIMIT 1) END`
	}
	// groups' params; then $8 order by recency (else count); $9 a cursor is given,
	// with $10 its order value and $11 its ID; $12 the limit; $13 samples per
	// group; $14 the error code ('' for any).
	q.listGroups = groups + `, k AS (
				SELECT g.*, CASE WHEN $8 THEN (extract(epoch FROM g.last_seen) * 1000000)::bigint ELSE g.n END AS v,
					left(g.source, 1) || '-' || encode(g.grp, 'hex') AS id
				FROM g
				WHERE ` + ofCode("$14") + `
			), page AS (
				SELECT * FROM k WHERE NOT $9 OR k.v < $10 OR (k.v = $10 AND k.id > $11)
				ORDER BY k.v DESC, k.id LIMIT $12
			)
			SELECT ` + cols("page") + ` FROM page ` + samples("page", "$6", "$7", "$13") + `
			ORDER BY page.v DESC, page.id`
	// Every group of a shard for a merged list (shards.go), without its samples,
	// which are read for the page's groups alone: groups' params; $8 the error
	// code ('' for any).
	q.groupCounts = groups + `
			SELECT g.source, g.grp, g.place, g.tenant, g.n, g.first_seen, g.last_seen FROM g
			WHERE ` + ofCode("$8")
	// The samples of the groups named by $1 source, $2 hash, $3 consumer or kind
	// and $4 tenant (arrays, one element a group), in that order; $5 and $6 the
	// time range, $7 samples per group.
	q.groupSamples = `SELECT coalesce(s.code, ''), coalesce(s.masked, ''), coalesce(s.example, ''), s.keys
			FROM unnest($1::text[], $2::bytea[], $3::text[], $4::text[]) WITH ORDINALITY AS p(source, grp, place, tenant, i)
			` + samples("p", "$5", "$6", "$7") + `
			ORDER BY p.i`
	// The samples of one group, on Citus, which refuses groupSamples' join of the
	// groups with the tables: $1 source, $2 hash, $3 consumer or kind, $4 tenant;
	// $5 and $6 the time range, $7 samples. The group's tenant routes it to one
	// shard.
	q.groupSampleCitus = `SELECT coalesce(s.code, ''), coalesce(s.masked, ''), coalesce(s.example, ''), s.keys
			FROM (` + sampled("$1::text", "$2::bytea", "$3::text", "$4::text", "$5", "$6", "$7") + `) s`
	// $1 an inbox group (else effects), $2 its hash, $3 and $4 the time range, $5
	// samples.
	q.getGroup = `WITH g AS (
				` + agg(SourceInbox, inbox, "i", "consumer", "completed_at", "failed", `$1 AND i.error_group = $2 AND `+between("i.completed_at", "$3", "$4")) + `
				UNION ALL
				` + agg(SourceEffects, effects, "e", "kind", "dead_at", "dead", `NOT $1 AND e.error_group = $2 AND `+between("e.dead_at", "$3", "$4")) + `
			)
			SELECT ` + cols("g") + ` FROM g ` + samples("g", "$3", "$4", "$5") + `
			ORDER BY g.n DESC LIMIT 1`
	q.groupAttempts = `SELECT attempts, count(*) FROM ` + effects + ` e
			WHERE e.error_group = $1 AND e.state = 'dead' AND ` + between("e.dead_at", "$2", "$3") + `
			GROUP BY attempts ORDER BY attempts`

	// The actions: $1 the group's hash, $2 since (or NULL), $3 through, $4 how many
	// keys to name; then $5 who, $6 why, and $7 the schema, for retry's wake-up.
	// The Admin bounds the rows an action changes (GroupAction.AtMost) across its
	// parts, each action's statement in a transaction it commits or rolls back.
	// Each is one statement: the change and its audit row commit together. The
	// change is a conditional UPDATE (or DELETE) on the state the group's rows
	// have, so two operators acting at once change each row once: the second waits
	// for the first's row lock, then finds the row no longer dead (or failed) and
	// leaves it. No read comes before the write.
	type target struct{ table, alias, place, at, state string }
	targets := map[string]target{
		ActionRetry:   {effects, "e", "kind", "dead_at", "dead"},
		ActionDiscard: {effects, "e", "kind", "dead_at", "dead"},
		ActionRelease: {inbox, "i", "consumer", "completed_at", "failed"},
	}
	change := map[string]func(where string) string{
		ActionRetry: func(where string) string {
			return `UPDATE ` + effects + ` e SET state = 'pending', attempts = 0, next_attempt_at = now(), done_at = NULL WHERE ` + where
		},
		ActionDiscard: func(where string) string {
			return `UPDATE ` + effects + ` e SET state = 'discarded', done_at = now() WHERE ` + where
		},
		ActionRelease: func(where string) string {
			return `DELETE FROM ` + inbox + ` i WHERE ` + where
		},
	}
	q.plan, q.act = map[string]string{}, map[string]string{}
	for action, tg := range targets {
		a := tg.alias
		where := a + `.error_group = $1 AND ` + a + `.state = '` + tg.state + `' AND ` + a + `.` + tg.at + ` <= $3
				AND ($2::timestamptz IS NULL OR ` + a + `.` + tg.at + ` >= $2)`
		keys := `(SELECT coalesce(array_agg(key ORDER BY key), '{}') FROM (SELECT key FROM moved ORDER BY key LIMIT $4) k)`
		q.plan[action] = `WITH moved AS (SELECT ` + a + `.key FROM ` + tg.table + ` ` + a + ` WHERE ` + where + `)
			SELECT (SELECT count(*) FROM moved), ` + keys + `, now(), NULL::text`
		source := SourceEffects
		if tg.table == inbox {
			source = SourceInbox
		}
		wake, wakeFrom := "", ""
		if action == ActionRetry {
			// Dispatchers wake when the retry commits.
			// pg_notify returns void, which Citus cannot carry out of a CTE: the
			// cast to text lets it run the CTE on the coordinator, where the
			// dispatchers listen.
			wake, wakeFrom = `, wake AS (SELECT pg_notify('idem_effects', $7)::text)`, `, wake`
		}
		q.act[action] = `WITH moved AS (` + change[action](where) + `
				RETURNING ` + a + `.key, ` + a + `.` + tg.place + ` AS place, ` + a + `.tenant
			), audit AS (
				INSERT INTO ` + actions + ` (action, source, group_id, place, tenant, through, affected, who, why)
				SELECT '` + action + `', '` + source + `', $1, coalesce(min(place), ''), coalesce(min(tenant), ''), $3, count(*), $5, $6
				FROM moved
				RETURNING id, at
			)` + wake + `
			SELECT (SELECT count(*) FROM moved), ` + keys + `, audit.at, audit.id::text
			FROM audit` + wakeFrom
	}
	q.listActions = `SELECT id::text, at, action, source, group_id, place, tenant, through, affected, who, why
			FROM ` + actions + `
			WHERE ($1::bytea IS NULL OR group_id = $1) AND ` + between("at", "$2", "$3") + `
				AND ($4::timestamptz IS NULL OR (at, id) < ($4, nullif($5, '')::uuid))
			ORDER BY at DESC, id DESC LIMIT $6`

	// The failure metrics: one statement, index-only scans of the two group indexes
	// (they hold the consumer and the kind) and the audit table.
	q.failureMetrics = `SELECT 'inbox', consumer, count(*)::float8 FROM ` + inbox + ` WHERE state = 'failed' GROUP BY consumer
			UNION ALL
			SELECT 'effects', kind, count(*)::float8 FROM ` + effects + ` WHERE state = 'dead' GROUP BY kind
			UNION ALL
			SELECT 'action', action, sum(affected)::float8 FROM ` + actions + ` GROUP BY action`

	// The backfill of failures recorded before the group columns existed: their
	// error_group is NULL. They are read in the group index's order from its NULL
	// end (a backward scan of inbox_failure_group_idx yields the NULLs first), so
	// the read is a probe of the index whatever the statistics say: a plain
	// "error_group IS NULL" filter is estimated from the whole table, where every
	// completed key has a NULL group, and planned as a pass over the table that
	// finds nothing. The caller keeps the rows whose group is NULL. The write
	// checks that the row is still failed with the error that was masked.
	q.ungroupedInbox = `SELECT consumer, tenant, key, coalesce(error, ''), error_group IS NULL FROM ` + inbox + `
			WHERE state = 'failed' ORDER BY error_group DESC NULLS FIRST LIMIT $1`
	q.groupInbox = `UPDATE ` + inbox + ` i SET error_masked = u.masked,
				error_group = ` + failgroup.GroupSQL("i.consumer", "i.tenant", "i.error_code", "u.masked") + `
			FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[]) AS u(consumer, tenant, key, err, masked)
			WHERE i.consumer = u.consumer AND i.tenant = u.tenant AND i.key = u.key
				AND i.state = 'failed' AND i.error_group IS NULL AND coalesce(i.error, '') = u.err`
	// An effect that died before dead_at existed is taken to have died when its
	// last claim's lease ended (next_attempt_at), the closest time it kept.
	q.ungroupedEffects = `SELECT tenant, kind, key, coalesce(last_error, ''), error_group IS NULL FROM ` + effects + `
			WHERE state = 'dead' ORDER BY error_group DESC NULLS FIRST LIMIT $1`
	q.groupEffects = `UPDATE ` + effects + ` e SET error_masked = u.masked,
				error_group = ` + failgroup.GroupSQL("e.kind", "e.tenant", "e.error_code", "u.masked") + `,
				dead_at = coalesce(e.dead_at, e.next_attempt_at)
			FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[]) AS u(tenant, kind, key, err, masked)
			WHERE e.tenant = u.tenant AND e.kind = u.kind AND e.key = u.key
				AND e.state = 'dead' AND e.error_group IS NULL AND coalesce(e.last_error, '') = u.err`
}
