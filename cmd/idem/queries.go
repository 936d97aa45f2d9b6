package main

import "github.com/jackc/pgx/v5"

// The CLI's read-only statements, for one schema. Every value is a bind parameter;
// the schema is validated before it gets here and quoted.
type queries struct {
	effectsBySource, consumerStats, effectStats, effectsList, effectState string
}

func newQueries(schema string) queries {
	t := func(name string) string { return pgx.Identifier{schema, name}.Sanitize() }
	effectCols := `kind, key, state, attempts, max_attempts, next_attempt_at, created_at, done_at,
		coalesce(last_error, ''), coalesce(source_consumer, ''), coalesce(source_tenant, ''), coalesce(source_key, ''), now()`
	return queries{
		// The effects a message made, through effects_source_idx.
		effectsBySource: `SELECT ` + effectCols + ` FROM ` + t("effects") + `
			WHERE source_consumer = $1 AND source_tenant = $2 AND source_key = $3
			ORDER BY created_at, kind, key`,
		// stats reads whole tables: it is for an operator's question, not for a
		// scrape every few seconds (the Prometheus metrics are).
		consumerStats: `SELECT consumer, count(*),
				count(*) FILTER (WHERE state = 'completed'),
				count(*) FILTER (WHERE state = 'failed'),
				count(*) FILTER (WHERE state = 'processing'),
				count(*) FILTER (WHERE state <> 'processing' AND expires_at < now()),
				min(received_at)
			FROM ` + t("inbox") + ` GROUP BY consumer ORDER BY consumer`,
		effectStats: `SELECT kind,
				count(*) FILTER (WHERE state = 'pending'),
				count(*) FILTER (WHERE state = 'pending' AND next_attempt_at <= now()),
				count(*) FILTER (WHERE state = 'dead'),
				count(*) FILTER (WHERE state = 'done'),
				coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE state = 'pending')), 0)::float8
			FROM ` + t("effects") + ` GROUP BY kind ORDER BY kind`,
		effectsList: `SELECT ` + effectCols + ` FROM ` + t("effects") + `
			WHERE state = $1 AND ($2 = '' OR kind = $2)
			ORDER BY created_at, kind, key
			LIMIT $3`,
		effectState: `SELECT state FROM ` + t("effects") + ` WHERE kind = $1 AND key = $2`,
	}
}
