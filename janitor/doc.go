// Package janitor deletes what idem's retention lets go, in both of idem's tables:
// inbox rows (message keys and HTTP keys with their stored responses) that are
// completed or failed and past their expires_at, and effects that are done and
// older than the effects' retention.
//
// What it guarantees: it never deletes a processing inbox row (a lease) nor a
// pending or dead effect (work not yet settled, or waiting for an operator). It
// deletes in small batches, each its own short transaction, picked through the
// partial indexes the migrations create for it and locked with SKIP LOCKED, so it
// never waits on a row that a claim holds. One pass at a time runs per schema,
// across every process (a Postgres advisory lock), so every consumer or dispatcher
// process may run one.
//
// What it does not do: it decides nothing about a key's meaning. A row past its
// expires_at is forgotten by the next claim of its key whether or not the janitor
// has deleted it yet; the janitor only reclaims the space.
//
// It lives in a package of its own because it works on both tables; it imports
// nothing public of idem.
package janitor
