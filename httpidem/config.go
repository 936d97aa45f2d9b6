package httpidem

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/fanout"
	"github.com/idemkit/idem/shard"
)

// Defaults.
const (
	// DefaultKeyHeader is the request header that carries the key
	// (draft-ietf-httpapi-idempotency-key-header).
	DefaultKeyHeader = "Idempotency-Key"
	// DefaultRetention is how long a key and its stored response live: a day, as
	// payment APIs commonly keep theirs. A retry after it runs as a new request.
	DefaultRetention = 24 * time.Hour
	// DefaultSchema holds the idem tables unless Config.Schema says otherwise.
	DefaultSchema = inbox.DefaultSchema
	// DefaultLockTimeout bounds how long a request waits for another request with
	// the same key to finish before it answers 409.
	DefaultLockTimeout = 2 * time.Second
	// DefaultRetryAfter is the Retry-After of 409 and 503 answers.
	DefaultRetryAfter = time.Second
	// DefaultMaxRequestBody is the largest request body read (and fingerprinted).
	DefaultMaxRequestBody = 1 << 20
	// DefaultMaxResponseBody is the largest response body stored.
	DefaultMaxResponseBody = 1 << 20
	// DefaultLease is the lease of a key in lease mode.
	DefaultLease = 30 * time.Second
	// MaxStoredBody caps MaxResponseBody: stored responses are rows, not blobs.
	MaxStoredBody = 64 << 20
)

// DefaultStoredHeaders are the response headers stored and replayed unless
// Config.StoredHeaders says otherwise: those that describe the body, the created
// resource, and how a cache may keep the answer (a replay must not be cached
// where the first answer was not).
var DefaultStoredHeaders = []string{"Content-Type", "Content-Encoding", "Content-Language", "Content-Location", "Location", "ETag", "Last-Modified", "Link", "Cache-Control"}

// sensitiveHeaders carry credentials: Config.StoredHeaders may name them only with
// Config.StoreSensitiveHeaders set, since a stored answer is replayed to whoever
// presents its key (in its scope) for as long as the key lives.
var sensitiveHeaders = []string{"Authorization", "Proxy-Authorization", "Cookie", "Set-Cookie", "Set-Cookie2", "Authentication-Info", "Proxy-Authentication-Info"}

// defaultFinalStatus is Config.FinalStatus's default (see there).
func defaultFinalStatus(status int) bool {
	switch {
	case status >= 200 && status < 300, status >= 300 && status < 400 && status != http.StatusNotModified:
		return true
	case status == http.StatusBadRequest, status == http.StatusUnprocessableEntity:
		return true
	}
	return false
}

// Response is an HTTP response as idem stores and replays it.
type Response struct {
	Status int
	Header http.Header
	Body   []byte
}

// A BodyReferencer keeps response bodies that hold personal data out of the inbox:
// a reference is stored instead, and resolved again on a replay.
//
// A replay then sends what Body returns at that moment, which is the stored
// response byte for byte only if Body renders the same bytes (the resource did not
// change since).
type BodyReferencer interface {
	// Reference returns what to store instead of resp's body, or "" to store the
	// body itself. It runs for 2xx and 3xx responses, in the request's transaction
	// (Tx(ctx)), after the handler and before the commit; an error rolls the
	// request back (500). The reference is at most 512 bytes of UTF-8.
	Reference(ctx context.Context, r *http.Request, resp *Response) (string, error)
	// Body returns the body for a replay of the response stored with ref. An error
	// answers the replay with 500 (replay_failed).
	Body(ctx context.Context, ref string) ([]byte, error)
}

// Lease configures lease mode, for the routes that choose it (Route.Lease): the key
// commits first as in progress, with a lease and a fence, for handlers that call a
// provider themselves. See the package documentation for what it cannot promise.
type Lease struct {
	// Duration is the lease of a key (default 30 s). It must exceed the handler's
	// longest run.
	Duration time.Duration
	// Recover decides what to do with a key whose lease ran out (see Stale). It
	// runs in the request's transaction, as the handler does: Tx(ctx) writes the
	// business rows that record what the provider did, effects.Enqueue(ctx, Tx(ctx),
	// …) enqueues effects, and KeyFrom(ctx) gives the key. Return a Response to
	// settle the key with it (you asked the provider and it had done the work): a
	// success commits with Recover's writes, a final client error is stored after
	// they roll back. Return nil to run the handler again, in the same transaction,
	// after Recover's writes. An error (or a panic) rolls back, answers 503 and
	// leaves the key to a later retry. Default: run again. Use Tx(ctx), not the
	// pool: the request already holds a connection.
	Recover func(ctx context.Context, s Stale) (*Response, error)
}

// Stale describes a key whose lease ran out (lease mode): an earlier attempt began
// and did not settle. It crashed, outlived its lease, or answered with a status that
// is not final; it may have called the provider.
type Stale struct {
	Request   *http.Request
	Operation string
	Tenant    string
	Key       string
	// Fence is this attempt's fence (the lease was taken over with fence + 1).
	Fence int64
}

// Config configures a Middleware.
type Config struct {
	// Pool runs the transactions. Required. A request holds at most one connection
	// at a time, on every path, from its claim to its commit (and while it waits
	// for a concurrent request with the same key in transactional mode), and gives
	// it back before its answer is written, so a pool of N serves N requests in
	// flight however slowly their clients read.
	Pool *pgxpool.Pool
	// Schema holds the idem tables (default "idem"), migrated to 003 or later.
	Schema string
	// Shards, in place of Pool and Schema, spreads the requests over several
	// databases (see package shard); Pool and Schema must then be unset, and Tenant
	// set: the request's tenant picks its shard before the claim.
	Shards *shard.Map
	// SkipSchemaCheck turns off the check that New makes at start: that
	// Schema (each shard's, with Shards) holds idem's tables at the newest
	// migration this build knows. Set it only for a role that may not read
	// Postgres's catalog (New then fails with code schema_check_refused); a schema
	// that lacks a migration is then found only by the first request, which is answered 503 (database_unavailable) and logged.
	SkipSchemaCheck bool

	// KeyHeader names the key's header (default "Idempotency-Key"). A value that
	// starts with a double quote is a Structured Field Item whose value is a
	// String (RFC 9651), as the IETF draft writes it: the key is the string, and
	// parameters ("abc";p=1) are ignored. Any other value is the key as it is.
	// Keys follow the inbox rules: 1..512 bytes of UTF-8.
	KeyHeader string
	// KeyOptional lets a request without the key through: it runs once per request,
	// in a transaction, with nothing stored. By default a missing key is a 400.
	// Route.KeyOptional sets it per route.
	KeyOptional bool
	// Operation names a request's operation, the inbox consumer its key lives
	// under, so keys never collide across operations. Default: the method and the
	// http.ServeMux pattern ("POST /payments/{id}/refunds"; a pattern that names
	// its method is used as it is), and without a pattern (the middleware wraps the
	// whole mux) the request is answered 500 (operation_unknown): wrap each route's
	// handler, or set Operation. For another router, return its route template
	// (chi: chi.RouteContext(r.Context()).RoutePattern()), never the raw path.
	Operation func(r *http.Request) (string, error)
	// Tenant scopes keys: it returns the authenticated principal's tenant, and two
	// tenants' equal keys are two requests. An error, or an empty tenant, answers
	// 400 (tenant_invalid) before anything runs; authenticate before this
	// middleware. Set Tenant, or Unscoped: New refuses a config with neither
	// (ErrScopeNotChosen). It is called once per request that is not passed
	// through (a safe method); with Shards the tenant also picks the shard.
	Tenant func(r *http.Request) (string, error)
	// Unscoped puts every client's keys in one space, on purpose: a client that
	// presents another client's key and request gets that client's stored answer.
	// Choose it only where every caller may see every other caller's answers (one
	// trusted client, or keys that are capabilities); otherwise set Tenant.
	Unscoped bool
	// Fingerprint, if set, replaces the default fingerprint. It gets a clone of the
	// request without the Authorization, Cookie and key headers, and the body. An
	// error answers 400 (fingerprint_failed).
	//
	// The default is sha256 over the method, the escaped path, the query (its
	// parameters sorted by name) and the body. A body that is JSON counts by its
	// canonical form with exact numbers (canonjson.Canonicalize, with the fields that
	// Fields chooses), whatever its Content-Type says; a body that declares a JSON
	// media type and is not JSON is answered 400 (body_not_json); a form counts by
	// its fields sorted by name; any other body counts byte for byte, with its
	// media type. Headers never count. The path is there because the operation is
	// the route template: the same key and body on POST /accounts/1/payments and
	// POST /accounts/2/payments are two different commands.
	Fingerprint func(r *http.Request, body []byte) ([]byte, error)
	// Fields chooses the JSON fields the default fingerprint covers. It does
	// nothing with Fingerprint set, and Validate refuses it then.
	Fields inbox.JSONOptions

	// FinalStatus reports whether a status is final, and so stored and replayed.
	// The default: 2xx and 3xx (except 304), 400 Bad Request and 422 Unprocessable
	// Content, the answers to a request that is itself wrong, which a retry can
	// only repeat. Any other status (5xx, 408, 409, 429, 401, 403, 404, …) is
	// passed to the client, not stored, and the handler's work is rolled back, so
	// a retry runs again. 5xx statuses are never final, whatever it says.
	FinalStatus func(status int) bool
	// StoredHeaders are the response headers stored and replayed (default
	// DefaultStoredHeaders). Content-Length is always computed. A header that
	// carries credentials (Set-Cookie, Authorization, …: see ErrSensitiveHeader) is
	// refused (ErrSensitiveHeader) unless StoreSensitiveHeaders is set.
	StoredHeaders []string
	// StoreSensitiveHeaders lets StoredHeaders name headers that carry
	// credentials: a session
	// cookie or a token in an answer is then stored with the key and replayed to
	// every retry in the key's scope until the key expires.
	StoreSensitiveHeaders bool
	// MaxRequestBody is the largest request body (default 1 MiB); a larger one is
	// answered 413 before anything runs.
	MaxRequestBody int64
	// MaxResponseBody is the largest response body (default 1 MiB, at most 64 MiB).
	// A handler that writes more is rolled back and answered 500
	// (response_too_large): an answer that cannot be stored cannot be promised.
	// Use a BodyReferencer for large bodies.
	MaxResponseBody int
	// BodyReference, if set, stores references instead of 2xx and 3xx bodies.
	BodyReference BodyReferencer

	// LockTimeout bounds the wait for a concurrent request with the same key
	// (default 2 s); past it the answer is 409 with Retry-After. It is the claim's
	// lock_timeout in transactional mode, as the consumer's LockTimeout is.
	LockTimeout time.Duration
	// RetryAfter is the Retry-After of 409 and 503 answers (default 1 s).
	RetryAfter time.Duration
	// Retention is how long keys and responses live (default 24 h).
	Retention time.Duration

	// Lease configures lease mode, for the routes that run in it (Route.Lease).
	Lease Lease

	// EffectKinds, if set, are the only kinds effects.Enqueue accepts in handlers.
	EffectKinds []string
	// Logger gets structured logs (nil: quiet). Bodies are never logged.
	Logger *slog.Logger
	// Registerer gets the idem_http_* collectors (nil: not registered).
	Registerer prometheus.Registerer
	// TracerProvider makes the OpenTelemetry spans of a keyed request, under the
	// span in its context (an HTTP server span, such as otelhttp's): "idem.claim"
	// (with the outcome: claimed, replayed, mismatch, busy, …), "idem.handler",
	// whose context the handler gets, so the effects it enqueues keep its trace
	// context, and "idem.commit". nil means otel.GetTracerProvider(): a no-op until
	// the application calls otel.SetTracerProvider, and that provider from then on.
	TracerProvider trace.TracerProvider
}

// WithDefaults returns c with every unset field at its default.
func (c Config) WithDefaults() Config {
	c.Schema = fanout.Schema(c.Shards, c.Schema, DefaultSchema)
	c.KeyHeader = http.CanonicalHeaderKey(cmp.Or(c.KeyHeader, DefaultKeyHeader))
	if c.Operation == nil {
		c.Operation = defaultOperation
	}
	if c.FinalStatus == nil {
		c.FinalStatus = defaultFinalStatus
	}
	if c.StoredHeaders == nil {
		c.StoredHeaders = DefaultStoredHeaders
	}
	c.MaxRequestBody = cmp.Or(c.MaxRequestBody, DefaultMaxRequestBody)
	c.MaxResponseBody = cmp.Or(c.MaxResponseBody, DefaultMaxResponseBody)
	c.LockTimeout = cmp.Or(c.LockTimeout, DefaultLockTimeout)
	c.RetryAfter = cmp.Or(c.RetryAfter, DefaultRetryAfter)
	c.Retention = cmp.Or(c.Retention, DefaultRetention)
	c.Lease.Duration = cmp.Or(c.Lease.Duration, DefaultLease)
	c.Logger = cmp.Or(c.Logger, slog.New(slog.DiscardHandler))
	return c
}

// Validate reports what New would refuse in c: no Pool, no key scope chosen, a bad
// schema or key header, a limit or bound out of range, a stored header that must
// not be stored. It checks c.WithDefaults(), so a config that sets only Pool and
// Tenant (or Unscoped) passes.
func (c Config) Validate() error {
	c = c.WithDefaults()
	if err := fanout.ValidateDB(c.Shards, c.Pool, c.Schema); err != nil {
		return err
	}
	if c.Shards != nil && c.Tenant == nil {
		return errcode.InvalidConfig("Shards routes by tenant: set Tenant")
	}
	switch {
	case c.Tenant == nil && !c.Unscoped:
		return fmt.Errorf("%w: neither is set", ErrScopeNotChosen)
	case c.Tenant != nil && c.Unscoped:
		return fmt.Errorf("%w: both are set", ErrScopeNotChosen)
	}
	if c.KeyHeader == "" || strings.ContainsAny(c.KeyHeader, " \t\r\n:") {
		return errcode.InvalidConfig("KeyHeader %q is not a header name", c.KeyHeader)
	}
	switch c.KeyHeader {
	case "Authorization", "Cookie", "Content-Type", "Content-Length":
		return errcode.InvalidConfig("KeyHeader %q is not a key header", c.KeyHeader)
	}
	if c.MaxRequestBody < 0 {
		return errcode.InvalidConfig("MaxRequestBody %d is negative", c.MaxRequestBody)
	}
	if c.MaxResponseBody < 0 || c.MaxResponseBody > MaxStoredBody {
		return errcode.InvalidConfig("MaxResponseBody %d is outside 0..%d", c.MaxResponseBody, MaxStoredBody)
	}
	if c.LockTimeout < time.Millisecond {
		return errcode.InvalidConfig("LockTimeout %s is under a millisecond", c.LockTimeout)
	}
	if c.RetryAfter < 0 {
		return errcode.InvalidConfig("RetryAfter %s is negative", c.RetryAfter)
	}
	if c.Retention < time.Minute {
		return errcode.InvalidConfig("Retention %s is under a minute; it must exceed the longest time a client retries", c.Retention)
	}
	if c.Lease.Duration < 10*time.Millisecond {
		return errcode.InvalidConfig("Lease.Duration %s is under 10 ms", c.Lease.Duration)
	}
	if c.Fingerprint != nil && (len(c.Fields.Include) > 0 || len(c.Fields.Exclude) > 0) {
		return errcode.InvalidConfig("Fields chooses the default fingerprint's fields and does nothing with Fingerprint set (a fingerprint of your own): unset one")
	}
	for _, h := range c.StoredHeaders {
		switch http.CanonicalHeaderKey(h) {
		case "Content-Length", "Transfer-Encoding", "Connection", ReplayedHeader:
			return errcode.InvalidConfig("StoredHeaders: %q is computed on every answer, never stored", h)
		}
		if !c.StoreSensitiveHeaders && slices.Contains(sensitiveHeaders, http.CanonicalHeaderKey(h)) {
			return fmt.Errorf("%w: StoredHeaders names %q", ErrSensitiveHeader, h)
		}
	}
	return nil
}

// Route overrides the Config for one route.
type Route struct {
	// Operation names this route's operation (instead of Config.Operation). With it
	// set, the route's metrics exist from the start.
	Operation string
	// KeyOptional lets requests without the key through (see Config.KeyOptional).
	KeyOptional bool
	// Lease runs this route in lease mode (see Config.Lease): the key commits
	// first as in progress, with a lease and a fence, for handlers that call a
	// provider themselves. See the package documentation for what it cannot
	// promise.
	Lease bool
	// SafeMethods runs requests with a safe method (GET, HEAD, OPTIONS, TRACE)
	// through idem too: keyed, stored and replayed like any other, for a route
	// whose GET changes state. By default they pass through untouched (no key, no
	// transaction, nothing stored): a stored read would be replayed stale, and
	// GET and HEAD share a route, so one key on both would be a mismatch.
	SafeMethods bool
}

// safeMethod reports whether method is safe (RFC 9110, section 9.2.1).
func safeMethod(method string) bool {
	switch method {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
		return true
	}
	return false
}

// defaultOperation is Config.Operation's default (see there); without a pattern it
// fails with errNoOperation.
func defaultOperation(r *http.Request) (string, error) {
	if r.Pattern == "" {
		return "", errNoOperation
	}
	if strings.HasPrefix(r.Pattern, r.Method+" ") {
		return r.Pattern, nil
	}
	if i := strings.IndexByte(r.Pattern, ' '); i > 0 && !strings.Contains(r.Pattern[:i], "/") {
		return r.Pattern, nil // "GET /items" also serves HEAD
	}
	return r.Method + " " + r.Pattern, nil
}
