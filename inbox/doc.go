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
// The package holds what a user of the inbox types: the key rule (ValidateKey),
// the fingerprints (SHA256, CanonicalJSON), a row's ID and State (which admin and
// httpidem hand back), the coded errors and the constants. The Store that claims
// and settles keys is idem's own wiring: it lives in internal/inboxdb with the
// statements it shares with the consumer's set-based batch claim, httpidem's stored
// responses and the janitor, and the canonical JSON form in internal/canonjson. The
// schema and its migrator are package migrate, the janitor package janitor.
//
// inbox imports idem's internal leaf packages, nothing public of idem.
package inbox
