package inbox

// queries holds every statement of the store, rendered once for one schema. Every
// value is a bind parameter; the schema is validated and quoted.
type queries struct {
	claim, fail, get                              string
	claimBatch, getBatch                          string
	lease, completeLease, failLease, releaseLease string
	deleteExpiredKey, deleteExpiredKeys           string
	deleteExpired, deleteDoneEffects              string
	janitorTryLock, janitorUnlock                 string
}

func newQueries(schema string) queries {
	t := schema + ".inbox"
	e := schema + ".effects"
	return queries{
		// Times come from the database (now()), never the application's clock.
		claim: `INSERT INTO ` + t + ` (consumer, tenant, key, fingerprint, state, completed_at, expires_at)
			VALUES ($1, $2, $3, $4, 'completed', now(), now() + $5::interval)
			ON CONFLICT (consumer, tenant, key) DO NOTHING
			RETURNING true`,
		fail: `INSERT INTO ` + t + ` (consumer, tenant, key, fingerprint, state, completed_at, expires_at, error_code, error)
			VALUES ($1, $2, $3, $4, 'failed', now(), now() + $5::interval, $6, $7)
			ON CONFLICT (consumer, tenant, key) DO NOTHING
			RETURNING true`,
		get: `SELECT consumer, tenant, key, fingerprint, state, error_code, error, attempts,
				lease_until, fence, received_at, completed_at, expires_at, now()
			FROM ` + t + ` WHERE consumer = $1 AND tenant = $2 AND key = $3`,
		// The set-based claim of a group-commit batch (ClaimBatchTx). The keys come
		// sorted, and ORDER BY ord (free: unnest WITH ORDINALITY yields that order)
		// keeps the inserts, and so the row locks and the waits for concurrent
		// claimers, in that order: two batches that share keys cannot deadlock. A row
		// comes back for each key it inserted (claimed true), and for each key whose
		// row the statement's snapshot sees (claimed false): rows committed before it
		// began, such as the original of a redelivered message. The probe unnests the
		// keys again (a CTE shared with the INSERT would be materialized and sorted),
		// and is a LATERAL subquery on the primary key, one index lookup per key
		// whatever the statistics say: OFFSET 0 keeps the planner from flattening it
		// into a join, which it plans (and pgx's prepared statement caches) as a hash
		// join over a sequential scan of the whole inbox while the table is new and
		// not yet analyzed (TestClaimBatchPlanNeedsNoStatistics). The probe cannot
		// see a row that a concurrent claimer committed while this INSERT waited for
		// it; getBatch reads those afterwards. Times are the database's; retention is
		// in microseconds. failed, error_code and error may be NULL arrays (no failure
		// to record), which unnest pads with NULLs.
		claimBatch: `WITH ins AS (
				INSERT INTO ` + t + ` (consumer, tenant, key, fingerprint, state, completed_at, expires_at, error_code, error)
				SELECT consumer, tenant, key, fingerprint,
					CASE WHEN failed THEN 'failed' ELSE 'completed' END, now(),
					now() + retention_us * interval '1 microsecond',
					CASE WHEN failed THEN error_code END, CASE WHEN failed THEN error END
				FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::bool[],
						$6::text[], $7::text[], $8::bigint[]) WITH ORDINALITY
					AS u(consumer, tenant, key, fingerprint, failed, error_code, error, retention_us, ord)
				ORDER BY ord
				ON CONFLICT (consumer, tenant, key) DO NOTHING
				RETURNING consumer, tenant, key
			)
			SELECT true, consumer, tenant, key, NULL::bytea, NULL::text, NULL::text, NULL::text, NULL::int,
				NULL::timestamptz, NULL::bigint, NULL::timestamptz, NULL::timestamptz, NULL::timestamptz, NULL::timestamptz
			FROM ins
			UNION ALL
			SELECT false, i.consumer, i.tenant, i.key, i.fingerprint, i.state, i.error_code, i.error, i.attempts,
				i.lease_until, i.fence, i.received_at, i.completed_at, i.expires_at, now()
			FROM unnest($1::text[], $2::text[], $3::text[]) AS u(consumer, tenant, key)
			CROSS JOIN LATERAL (
				SELECT * FROM ` + t + ` i
				WHERE i.consumer = u.consumer AND i.tenant = u.tenant AND i.key = u.key
				OFFSET 0
			) i`,
		getBatch: `SELECT false, i.consumer, i.tenant, i.key, i.fingerprint, i.state, i.error_code, i.error, i.attempts,
				i.lease_until, i.fence, i.received_at, i.completed_at, i.expires_at, now()
			FROM unnest($1::text[], $2::text[], $3::text[]) AS u(consumer, tenant, key)
			CROSS JOIN LATERAL (
				SELECT * FROM ` + t + ` i
				WHERE i.consumer = u.consumer AND i.tenant = u.tenant AND i.key = u.key
				OFFSET 0
			) i`,
		// A processing row whose lease ran out is taken over in the same statement,
		// fence + 1, so two deliveries can never both believe they hold the key. The
		// fingerprint must match: a different command never takes over a key.
		lease: `INSERT INTO ` + t + ` AS i (consumer, tenant, key, fingerprint, state, lease_until, fence, expires_at)
			VALUES ($1, $2, $3, $4, 'processing', now() + $6::interval, 1, now() + $5::interval)
			ON CONFLICT (consumer, tenant, key) DO UPDATE
				SET fence = i.fence + 1, lease_until = EXCLUDED.lease_until, attempts = i.attempts + 1
				WHERE i.state = 'processing' AND i.lease_until < now() AND i.fingerprint = EXCLUDED.fingerprint
			RETURNING fence`,
		completeLease: `UPDATE ` + t + ` SET state = 'completed', completed_at = now(), lease_until = NULL,
				expires_at = now() + $5::interval
			WHERE consumer = $1 AND tenant = $2 AND key = $3 AND fence = $4 AND state = 'processing'`,
		failLease: `UPDATE ` + t + ` SET state = 'failed', completed_at = now(), lease_until = NULL,
				expires_at = now() + $5::interval, error_code = $6, error = $7
			WHERE consumer = $1 AND tenant = $2 AND key = $3 AND fence = $4 AND state = 'processing'`,
		releaseLease: `UPDATE ` + t + ` SET lease_until = now()
			WHERE consumer = $1 AND tenant = $2 AND key = $3 AND fence = $4 AND state = 'processing'`,
		// A claim that meets a settled row past its expiry deletes it and claims the
		// key again (insertOr, ClaimBatchTx): a key past its retention is forgotten
		// whether or not the janitor has come by. Only such a row goes; a processing
		// row never does. A row that a concurrent claimer deletes first makes this
		// delete wait for it, then find nothing: the claim that follows meets that
		// claimer's row.
		deleteExpiredKey: `DELETE FROM ` + t + `
			WHERE consumer = $1 AND tenant = $2 AND key = $3
				AND state IN ('completed', 'failed') AND expires_at < now()`,
		deleteExpiredKeys: `DELETE FROM ` + t + ` i
			USING unnest($1::text[], $2::text[], $3::text[]) AS u(consumer, tenant, key)
			WHERE i.consumer = u.consumer AND i.tenant = u.tenant AND i.key = u.key
				AND i.state IN ('completed', 'failed') AND i.expires_at < now()`,
		// The janitor's deletes pick a batch in expiry order through the partial
		// indexes (inbox_expires_at_idx, effects_done_at_idx), so no batch rescans
		// the rows that earlier batches left dead, and delete by ctid, which the
		// row lock of the same statement pins. SKIP LOCKED: a row someone holds is
		// left for the next pass rather than waited for. The state filters keep
		// processing inbox rows and pending or dead effects out, always.
		deleteExpired: `DELETE FROM ` + t + ` WHERE ctid = ANY (ARRAY(
				SELECT ctid FROM ` + t + `
				WHERE state IN ('completed', 'failed') AND expires_at < now()
				ORDER BY expires_at
				LIMIT $1
				FOR UPDATE SKIP LOCKED))
			AND state IN ('completed', 'failed')`,
		deleteDoneEffects: `DELETE FROM ` + e + ` WHERE ctid = ANY (ARRAY(
				SELECT ctid FROM ` + e + `
				WHERE state = 'done' AND done_at < now() - $2::interval
				ORDER BY done_at
				LIMIT $1
				FOR UPDATE SKIP LOCKED))
			AND state = 'done'`,
		// One lock per schema, in the same key space as the migrator's lock.
		janitorTryLock: `SELECT pg_try_advisory_lock(hashtextextended('idem.janitor:' || $1, 0))`,
		janitorUnlock:  `SELECT pg_advisory_unlock(hashtextextended('idem.janitor:' || $1, 0))`,
	}
}
