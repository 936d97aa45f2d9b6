package admin

import "github.com/jackc/pgx/v5"

// queries holds every statement of the package, rendered once for one schema.
// Every value is a bind parameter; the schema is validated before it gets here and
// quoted.
//
// Lists page by keyset over the primary key: "(pk) > (cursor)" is an index
// condition of the primary key's B-tree, so a page costs the rows it returns (plus
// those the filters skip), never the pages before it. A list without a cursor
// starts after (”, ”, ”), which every row follows (a consumer name and an effect
// kind are never empty), so the statement and its plan are the same for every page.
type queries struct {
	consumerStats, effectStats string
	listInbox, listEffects     string
	getInbox                   string
	getEffect, effectsBySource string
	findInbox, findEffects     string
	// Find on Citus, which refuses the loose index scan's recursive CTE across
	// shards.
	findInboxCitus, findEffectsCitus string
	forget, inboxState               string

	// Failure groups (failures.go).
	listGroups, getGroup, groupAttempts string
	groupCounts, groupSamples           string
	groupSampleCitus                    string
	plan, act                           map[string]string
	listActions, failureMetrics         string
	ungroupedInbox, groupInbox          string
	ungroupedEffects, groupEffects      string

	// Activity (activity.go).
	activityInbox, activityEffects, activityBacklog string
}

// inboxColumns are an inbox row's columns for scanInboxKey.
const inboxColumns = `i.consumer, i.tenant, i.key, i.fingerprint, i.state, coalesce(i.error_code, ''), coalesce(i.error, ''),
	i.attempts, i.lease_until, i.fence, i.received_at, i.completed_at, i.expires_at, now(),
	i.response_status, i.response_headers, octet_length(i.response_body), i.response_ref`

// effectColumns are an effect row's columns for scanEffect. The payload is read as
// its size only.
const effectColumns = `e.tenant, e.kind, e.key, e.state, e.attempts, e.max_attempts, e.in_flight,
	e.next_attempt_at, e.created_at, e.done_at, coalesce(e.last_error, ''), coalesce(octet_length(e.payload), 0),
	coalesce(e.source_consumer, ''), coalesce(e.source_tenant, ''), coalesce(e.source_key, ''), now()`

// stuckWhere says when a pending effect looks stuck: a claim holds it (in_flight: it
// is being sent, or its sender died and the lease has not been taken over yet), it
// has been due for longer than $stuckAfter without a claim (no dispatcher sends its
// kind), or it has failed $stuckAttempts times or more.
func stuckWhere(after, attempts string) string {
	return `(e.state = 'pending' AND (e.in_flight OR e.next_attempt_at < now() - ` + after + `::interval
		OR e.attempts >= ` + attempts + `))`
}

// pairsOf is a CTE "pairs" of the distinct (a, b) pairs of table, in order, found
// by a loose index scan: one probe of the index that leads with (a, b) per pair.
func pairsOf(table, a, b string) string {
	return `WITH RECURSIVE pairs AS (
				(SELECT ` + a + `, ` + b + ` FROM ` + table + ` ORDER BY ` + a + `, ` + b + ` LIMIT 1)
				UNION ALL
				SELECT n.` + a + `, n.` + b + ` FROM pairs p CROSS JOIN LATERAL (
					SELECT ` + a + `, ` + b + ` FROM ` + table + `
					WHERE (` + a + `, ` + b + `) > (p.` + a + `, p.` + b + `)
					ORDER BY ` + a + `, ` + b + ` LIMIT 1) n
			)`
}

func newQueries(schema string) queries {
	t := func(name string) string { return pgx.Identifier{schema, name}.Sanitize() }
	inbox, effects := t("inbox"), t("effects")
	icols := inboxColumns
	q := queries{
		// Stats read whole tables: they answer an operator's question, not a scrape
		// every few seconds (the Prometheus metrics do that).
		consumerStats: `SELECT consumer, count(*),
				count(*) FILTER (WHERE state = 'completed'),
				count(*) FILTER (WHERE state = 'failed'),
				count(*) FILTER (WHERE state = 'processing'),
				count(*) FILTER (WHERE state <> 'processing' AND expires_at < now()),
				min(received_at),
				coalesce(extract(epoch FROM now() - min(received_at) FILTER (WHERE state = 'processing')), 0)::float8
			FROM ` + inbox + ` GROUP BY consumer ORDER BY consumer`,
		effectStats: `SELECT e.kind,
				count(*) FILTER (WHERE e.state = 'pending'),
				count(*) FILTER (WHERE e.state = 'pending' AND e.next_attempt_at <= now()),
				count(*) FILTER (WHERE e.state = 'dead'),
				count(*) FILTER (WHERE e.state = 'done'),
				count(*) FILTER (WHERE e.state = 'discarded'),
				count(*) FILTER (WHERE e.state = 'pending' AND e.in_flight),
				count(*) FILTER (WHERE ` + stuckWhere("$1", "$2") + `),
				coalesce(extract(epoch FROM now() - min(e.created_at) FILTER (WHERE e.state = 'pending')), 0)::float8
			FROM ` + effects + ` e GROUP BY e.kind ORDER BY e.kind`,
		listInbox: `SELECT ` + icols + ` FROM ` + inbox + ` i
			WHERE ($1 = '' OR i.consumer = $1)
				AND ($2::text IS NULL OR i.tenant = $2)
				AND ($3 = '' OR i.state = $3)
				AND ($4 = '' OR starts_with(i.key, $4))
				AND ($5::timestamptz IS NULL OR i.received_at >= $5)
				AND ($6::timestamptz IS NULL OR i.received_at < $6)
				AND (i.consumer, i.tenant, i.key) > ($7, $8, $9)
			ORDER BY i.consumer, i.tenant, i.key
			LIMIT $10`,
		listEffects: `SELECT ` + effectColumns + ` FROM ` + effects + ` e
			WHERE ($1::text IS NULL OR e.tenant = $1)
				AND ($2 = '' OR e.kind = $2)
				AND ($3 = '' OR e.state = $3)
				AND ($4 = '' OR starts_with(e.key, $4))
				AND ($5 = '' OR e.source_consumer = $5)
				AND ($6::timestamptz IS NULL OR e.created_at >= $6)
				AND ($7::timestamptz IS NULL OR e.created_at < $7)
				AND (NOT $8 OR ` + stuckWhere("$9", "$10") + `)
				AND (e.tenant, e.kind, e.key) > ($11, $12, $13)
			ORDER BY e.tenant, e.kind, e.key
			LIMIT $14`,
		// One key with its stored response's body (scanInboxKey's extra column).
		getInbox: `SELECT ` + icols + `, i.response_body FROM ` + inbox + ` i
			WHERE i.consumer = $1 AND i.tenant = $2 AND i.key = $3`,
		getEffect: `SELECT ` + effectColumns + ` FROM ` + effects + ` e
			WHERE e.tenant = $1 AND e.kind = $2 AND e.key = $3`,
		// The effects a message or request made, through effects_source_idx.
		effectsBySource: `SELECT ` + effectColumns + ` FROM ` + effects + ` e
			WHERE e.source_consumer = $1 AND e.source_tenant = $2 AND e.source_key = $3
			ORDER BY e.created_at, e.kind, e.key`,
		// A key without its consumer (or an effect key without its tenant and kind)
		// is not a prefix of the primary key. Rather than scan the table, walk the
		// distinct (consumer, tenant) pairs through the primary key's index, one
		// probe each (a loose index scan), and look the key up under each pair: the
		// cost grows with the number of pairs, not of rows.
		findInbox: pairsOf(inbox, "consumer", "tenant") + `
			SELECT ` + icols + ` FROM pairs JOIN ` + inbox + ` i
				ON i.consumer = pairs.consumer AND i.tenant = pairs.tenant AND i.key = $1
			WHERE ($2::text IS NULL OR pairs.tenant = $2)
			ORDER BY i.consumer, i.tenant
			LIMIT $3`,
		findEffects: pairsOf(effects, "tenant", "kind") + `
			SELECT ` + effectColumns + ` FROM pairs JOIN ` + effects + ` e
				ON e.tenant = pairs.tenant AND e.kind = pairs.kind AND e.key = $1
			WHERE ($2::text IS NULL OR pairs.tenant = $2) AND ($3 = '' OR pairs.kind = $3)
			ORDER BY e.tenant, e.kind
			LIMIT $4`,
		// Citus runs every shard's part of Find in parallel on the workers: each
		// reads its shard's rows for the key (the key alone is not a prefix of any
		// index), one scan of each shard.
		findInboxCitus: `SELECT ` + icols + ` FROM ` + inbox + ` i
			WHERE i.key = $1 AND ($2::text IS NULL OR i.tenant = $2)
			ORDER BY i.consumer, i.tenant
			LIMIT $3`,
		findEffectsCitus: `SELECT ` + effectColumns + ` FROM ` + effects + ` e
			WHERE e.key = $1 AND ($2::text IS NULL OR e.tenant = $2) AND ($3 = '' OR e.kind = $3)
			ORDER BY e.tenant, e.kind
			LIMIT $4`,
		// A processing key whose lease is still running is held by a delivery right
		// now: deleting it would let a second delivery claim the key while the first
		// one works. It is left alone (ErrLeaseHeld); a stale lease may go. The
		// columns (now() among them) are read from the deleted row outside the
		// DELETE: Citus refuses now() in RETURNING.
		forget: `WITH gone AS (
				DELETE FROM ` + inbox + ` i
				WHERE i.consumer = $1 AND i.tenant = $2 AND i.key = $3
					AND NOT (i.state = 'processing' AND i.lease_until > now())
				RETURNING i.*
			)
			SELECT ` + icols + ` FROM gone i`,
		inboxState: `SELECT state, lease_until FROM ` + inbox + `
			WHERE consumer = $1 AND tenant = $2 AND key = $3`,
	}
	failureQueries(&q, inbox, effects, t("failure_actions"))
	activityQueries(&q, inbox, effects)
	return q
}
