package inbox

// queries holds every statement of the store, rendered once for one schema. Every
// value is a bind parameter; the schema is validated and quoted.
type queries struct {
	claim, fail, get                              string
	lease, completeLease, failLease, releaseLease string
	deleteExpired                                 string
}

func newQueries(schema string) queries {
	t := schema + ".inbox"
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
		deleteExpired: `DELETE FROM ` + t + ` WHERE ctid = ANY (ARRAY(
				SELECT ctid FROM ` + t + `
				WHERE expires_at < now() AND state IN ('completed', 'failed')
				LIMIT $1))`,
	}
}
