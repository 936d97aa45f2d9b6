package effects

import "github.com/jackc/pgx/v5"

// notifyChannel is the channel the effects trigger notifies, with the schema name
// as payload.
const notifyChannel = "idem_effects"

// queries holds the Dispatcher's and requeue's statements, rendered once for one
// schema. Every value is a bind parameter; the schema is validated and quoted.
type queries struct {
	claim, record, notify, pending, requeue string
}

func newQueries(schema string) queries {
	t := pgx.Identifier{schema, "effects"}.Sanitize()
	return queries{
		// One statement claims up to n[i] due effects of each kind[i]. SKIP LOCKED
		// lets dispatchers claim side by side without waiting on each other. The
		// claim moves next_attempt_at to the end of the lease (a visibility timeout),
		// bumps fence and attempts, and sets in_flight. It commits on its own, before
		// any send. The old in_flight tells whether the previous attempt's outcome is
		// unknown; the old next_attempt_at is when the effect became due (for lag).
		// Times are the database's now(), never the application's clock.
		claim: `WITH want AS (
				SELECT * FROM unnest($1::text[], $2::int[]) AS w(kind, n)
			), due AS (
				SELECT c.* FROM want CROSS JOIN LATERAL (
					SELECT e.kind, e.key, e.in_flight, e.next_attempt_at
					FROM ` + t + ` e
					WHERE e.state = 'pending' AND e.kind = want.kind AND e.next_attempt_at <= now()
					ORDER BY e.next_attempt_at
					LIMIT want.n
					FOR UPDATE SKIP LOCKED
				) c
			)
			UPDATE ` + t + ` e
			SET next_attempt_at = now() + $3::interval, fence = e.fence + 1,
				attempts = e.attempts + 1, in_flight = true
			FROM due
			WHERE e.kind = due.kind AND e.key = due.key
			RETURNING e.kind, e.key, e.payload, e.attempts, e.max_attempts, e.fence,
				due.in_flight, e.created_at, extract(epoch FROM now() - due.next_attempt_at)::float8,
				coalesce(e.source_consumer, ''), coalesce(e.source_tenant, ''), coalesce(e.source_key, '')`,
		// Records a batch of outcomes in one statement. Each row applies only if the
		// fence still matches: an attempt whose lease ran out and was claimed again
		// cannot overwrite the newer attempt. The rows that come back are the ones
		// that applied. undo is 1 for a claim released without an attempt, which
		// gives the attempt back and restores the in_flight it found. Rows are sorted
		// by (kind, key) by the caller, so two recorders cannot deadlock.
		record: `UPDATE ` + t + ` e
			SET state = d.state,
				done_at = CASE WHEN d.state = 'done' THEN now() END,
				next_attempt_at = CASE WHEN d.state = 'pending'
					THEN now() + d.delay_ms * interval '1 millisecond' ELSE e.next_attempt_at END,
				in_flight = d.in_flight,
				attempts = e.attempts - d.undo,
				last_error = coalesce(d.err, e.last_error)
			FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::bigint[], $6::bool[], $7::int[], $8::text[])
				AS d(kind, key, fence, state, delay_ms, in_flight, undo, err)
			WHERE e.kind = d.kind AND e.key = d.key AND e.fence = d.fence AND e.state = 'pending'
			RETURNING e.kind, e.key`,
		notify:  `SELECT pg_notify('` + notifyChannel + `', $1)`,
		pending: `SELECT kind, count(*) FROM ` + t + ` WHERE state = 'pending' GROUP BY kind`,
		// Requeue notifies in the same statement, so the wake-up is delivered when the
		// requeue commits.
		requeue: `WITH r AS (
				UPDATE ` + t + `
				SET state = 'pending', attempts = 0, next_attempt_at = now(), done_at = NULL
				WHERE state = 'dead' AND ($1 = '' OR kind = $1) AND ($2 = '' OR key = $2)
				RETURNING 1
			)
			SELECT count(*), pg_notify('` + notifyChannel + `', $3) FROM r`,
	}
}
