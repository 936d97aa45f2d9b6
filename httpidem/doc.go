// Package httpidem is idem's Idempotency-Key middleware for net/http: a client that
// retries a command (POST /payments) with the same key gets the command run once
// and the same answer every time. It runs on the same Postgres inbox as idem's
// message consumers, with the same guarantees.
//
// Wrap each route's handler, so that the route pattern names the operation:
//
//	idem, err := httpidem.New(httpidem.Config{Pool: pool, Tenant: tenantOf})
//	mux.Handle("POST /payments", idem.Middleware(http.HandlerFunc(createPayment)))
//
// The handler writes through httpidem.Tx(ctx) and enqueues effects with
// effects.Enqueue(ctx, httpidem.Tx(ctx), …): they commit with the key and the
// stored response, or not at all. Outside the middleware (or on a safe-method
// request it passes through) there is no transaction: Tx panics with ErrNoTx,
// whose text says what to fix, and TxSafely returns it.
//
// The key's scope is chosen, never defaulted: Config.Tenant returns the
// authenticated principal's tenant, or Config.Unscoped puts every client's keys in
// one space on purpose; New refuses a config with neither (ErrScopeNotChosen),
// since without a scope a client that presents another client's key and request
// gets that client's stored answer. The key is the Idempotency-Key header: the
// draft's sf-string ("8e03978e-…", with any parameters after it ignored), or a
// bare value as it is. Requests with a safe method (GET, HEAD, OPTIONS, TRACE)
// pass through untouched unless Route.SafeMethods asks for keys.
//
// A request holds at most one pool connection at a time, on every path, and gives
// it back before its answer is written: a pool of N serves N requests in flight
// whatever they answer and however slowly their clients read.
//
// What it guarantees, for an operation O (method and route), a tenant T and a key
// K, while the key lives (Retention, default 24 h):
//
//   - Once per key. The handler's database work commits at most once, with
//     concurrent requests, retries, and a crash (kill -9) at any point: the key is
//     claimed by INSERT … ON CONFLICT as the first write of the request's
//     transaction, before the handler runs, the response is stored in that transaction, and the answer is
//     written only after COMMIT. A concurrent request with the key waits for the
//     first one (up to LockTimeout) and then gets its stored answer, or 409 with
//     Retry-After.
//   - The same answer. A retry after a final answer gets the stored status, the
//     allow-listed headers and the body byte for byte, with
//     "Idempotent-Replayed: true". A crash after the commit and before the answer
//     reached the client loses nothing: the retry gets the stored answer.
//   - Same key, different request, is loud: 422 (fingerprint_mismatch), never a
//     replay and never a second run. The fingerprint covers the method, the path,
//     the query and the body (canonical JSON with exact numbers), never a header.
//   - Never frozen. Only final answers are stored: 2xx, 3xx, and the client errors
//     FinalStatus names (400 and 422 by default). A 5xx, any other status, a panic,
//     a deadline or a client that went away roll the work back and store nothing, so
//     a retry runs the handler again. A final client error rolls the handler's work
//     back too, and records the answer.
//
// Every answer of idem's own is an RFC 9457 problem (application/problem+json)
// with a stable code (the Code* constants): 400 for a missing or invalid key, 413
// for a body over MaxRequestBody (before anything runs), 422 for a mismatch, 409
// while the key runs, 503 with Retry-After when Postgres is unavailable or a COMMIT's
// outcome is unknown (a retry settles it).
//
// What it does not do:
//
//   - Calls to the outside world from the handler are not made once. Enqueue them
//     as effects (the Dispatcher sends them after the commit, with a stable key),
//     or use lease mode.
//   - A retry after the retention runs as a new request: keys and stored responses
//     are deleted by the janitor (package janitor), and a key past its expiry is forgotten even
//     before the janitor comes.
//   - Bodies over MaxResponseBody are not stored: such a request is rolled back and
//     answered 500, every time. Raise the limit or store a reference
//     (BodyReferencer); a replay by reference is the resource as it is at replay
//     time, not necessarily the first answer's bytes.
//   - Headers outside StoredHeaders are sent on the first answer only. Headers
//     that carry credentials (Set-Cookie, Authorization, …: ErrSensitiveHeader) are
//     never stored unless StoreSensitiveHeaders says so.
//   - A handler must not end the transaction Tx(ctx) gives it. idem catches one
//     that does (raw COMMIT or ROLLBACK, with or without a BEGIN after it) and never
//     commits a transaction the handler began in its place; but what the handler's
//     own COMMIT committed, and what it wrote after its COMMIT or ROLLBACK outside
//     any transaction, stays committed without its answer. So the key is settled
//     with a stored 500 that every retry gets, and the handler never runs again:
//     handler_committed if its COMMIT committed the claim (a completed row),
//     handler_ended_transaction otherwise (a failed row, recorded in a fresh
//     transaction; message consumers record the same code). These are the only
//     5xx idem stores. A statement that fails inside the transaction is not an
//     end: Postgres rolls it all back; a final client error the handler answers
//     past it (a 422 for a unique violation) is stored like any other, and
//     anything else is not, so a retry runs again.
//     A crash between the handler's end of the transaction and the stored answer
//     leaves a key whose retries get 500 response_not_stored (after a COMMIT) or
//     run it again (after a ROLLBACK).
//
// Lease mode (Route{Lease: true}) is for handlers that must call a provider
// themselves and cannot hold a transaction open across the call. The key commits
// first as in progress, with a lease and a fence; a request that finds a fresh
// lease answers 409 after LockTimeout. When a lease runs out (the server crashed, or the
// handler outlived Lease.Duration, or answered a status that is not final), the next
// request takes it over with a new fence and Config.Lease.Recover decides, in the
// request's transaction (Tx(ctx), where it can write what the provider did): settle
// the key with a response (it asked the provider, which had done the work), or run
// the handler again. Lease mode cannot promise that the provider is called once: a
// crash after the call and before the commit, a handler that outlives its lease,
// or a Recover that cannot tell, lead to a second call. Pass the provider an
// idempotency key made from KeyFrom(ctx), so that a provider that honours keys
// applies it once. The database work still commits at most once (the fence).
//
// New checks the schema once, at start: it reads Postgres's catalog and refuses a
// schema (on any shard of a map) that lacks idem's tables or one of the migrations
// this build needs, with an error of code schema_missing that names the schema, the
// missing versions and `idem migrate up`. The check is bounded (10 seconds), and a
// database that does not answer within that time fails New with code
// database_unavailable (a shard of a map is only logged: the others are served).
// Config.SkipSchemaCheck turns it off, for a role that may not read the catalog; a
// schema that lacks a migration is then found by the first request, which is
// answered 503.
package httpidem
