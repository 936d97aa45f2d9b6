// Package inbox is idem's Postgres inbox: one row per (consumer, tenant, key) that
// records whether a message's work committed, failed permanently, or (in lease mode)
// is being processed.
//
// What it guarantees: a claim is one INSERT … ON CONFLICT DO NOTHING inside the
// caller's transaction, so the row commits with the caller's business writes or not
// at all, and a concurrent claim of the same key waits for the first transaction
// and then sees its outcome. A key seen again with a different payload fingerprint
// is reported as a mismatch, never as a duplicate. Keys are validated, and each
// failure is a permanent, typed error with a stable code. Times (expiry, leases) come
// from the database clock.
//
// What it does not do: it runs no handler and opens no transaction of its own except
// in lease mode; the consumer package does that. Rows live for their retention, and
// a duplicate that arrives after its row expired is not recognised.
//
// ClaimBatchTx claims many keys with one statement, in (consumer, tenant, key) order so
// that batches sharing keys cannot deadlock, and reads the committed rows of the keys
// it did not claim in the same statement when its snapshot sees them; the consumer's
// group commit uses it. Its commit guard (migration 004) is the consumer's.
//
// For package httpidem, a row may also hold the HTTP response given for its key
// (inbox/response.go, migration 003): stored in the transaction that claims the key,
// read back on a retry, and deleted by the janitor with the key.
//
// The package also holds the schema: numbered SQL migrations (MigrationsFS) and the
// Migrator that applies them, for the inbox and the effects tables alike. inbox and
// effects import pgx and nothing else of idem.
package inbox
