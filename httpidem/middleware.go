package httpidem

import (
	"errors"
	"fmt"
	"log/slog"
	"net/http"

	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/internal/citusmode"
	"github.com/idemkit/idem/internal/fanout"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/schemacheck"
	"github.com/idemkit/idem/internal/tracing"
	"github.com/idemkit/idem/shard"
)

// Middleware is the Idempotency-Key middleware. Wrap each route's handler with
// Middleware (or Route, for per-route options). It is safe for concurrent use.
//
// It reads each request, picks the part of its database (one database has one
// part; with Config.Shards the request's tenant picks its shard's part), and walks
// the request through that part: claim its key, run the handler, settle (store the
// answer and commit, or roll back), answer.
type Middleware struct {
	cfg   Config
	log   *slog.Logger
	parts *fanout.Set[*engine]
	// fingerprint is defaultFingerprint(cfg.Fields).
	fingerprint func(r *http.Request, body []byte) ([]byte, error)
}

// engine runs requests on one database: its inbox store, its metrics (labelled
// with the shard's name, with a shard map) and its spans.
type engine struct {
	cfg     Config
	store   *responseStore
	metrics *metrics
	log     *slog.Logger
	tracer  trace.Tracer
	// storedNames are cfg.StoredHeaders, canonical, sorted and unique.
	storedNames []string

	// afterCommit, if set, runs after a commit and before the answer is written
	// (tests kill the process there).
	afterCommit func(r *http.Request)
	// onLeaseWait, if set, runs when a lease-mode request starts to wait for a held
	// key (tests).
	onLeaseWait func(r *http.Request)

	// citus: whether the schema is distributed by Citus, asked on the first
	// request (onCitus).
	citus citusmode.Detector
}

// New validates cfg, checks the schema once, and returns a Middleware.
//
// The check (unless cfg.SkipSchemaCheck) reads Postgres's catalog: Schema, or
// every shard's schema, must hold idem's tables at the newest migration this build
// knows, whichever tool applied them. A schema that lacks them, or lacks a newer
// migration, fails with an error of code schema_missing that names the schema,
// the missing versions and `idem migrate up`; with Shards the error names each
// shard that failed. New takes no context: the check gives up after 10 seconds. A
// database that does not answer is tried again within that time, so a process
// that starts while Postgres restarts comes up once it is back. After that, without
// Shards, New fails with code database_unavailable (nothing could be served; the
// process's supervisor should start it again); a shard that does not answer is
// logged and left out of the check, and the other shards are served, as when a
// shard goes down later.
func New(cfg Config) (*Middleware, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	if err := schemacheck.Start(cfg.SkipSchemaCheck, cfg.Logger, fanout.SchemaTargets(cfg.Shards, cfg.Pool, cfg.Schema)); err != nil {
		return nil, err
	}
	parts, err := fanout.Build(cfg.Shards, cfg, cfg.forShard, newEngine)
	if err != nil {
		return nil, err
	}
	return &Middleware{cfg: cfg, log: cfg.Logger, parts: parts, fingerprint: defaultFingerprint(cfg.Fields)}, nil
}

// forShard returns c for sh's part: sh's database, and c's logger and registerer
// labelled with sh's name.
func (c Config) forShard(sh shard.Shard) Config {
	c.Shards, c.Pool, c.Schema = nil, sh.Pool, sh.SchemaName()
	c.Logger, c.Registerer = fanout.Label(sh, c.Logger, c.Registerer)
	return c
}

// newEngine returns the part for one database; cfg is validated and defaulted.
func newEngine(cfg Config) (*engine, error) {
	store, err := newResponseStore(cfg.Schema)
	if err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	if usePrepared(cfg.Pool.Config().ConnConfig) {
		store.prepared = newPreparedStmts(store)
	}
	met, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, fmt.Errorf("register metrics: %w", err)
	}
	return &engine{cfg: cfg, store: store, metrics: met, log: cfg.Logger,
		tracer:      tracing.Tracer(cfg.TracerProvider),
		storedNames: storedNames(cfg.StoredHeaders),
	}, nil
}

// Middleware wraps one route's handler with the Config's defaults. It is a
// func(http.Handler) http.Handler, for http.ServeMux, chi's With and the like.
func (m *Middleware) Middleware(next http.Handler) http.Handler { return m.Route(Route{})(next) }

// Route returns the middleware with rt's options for one route. It panics if
// rt.Operation is not a valid inbox consumer name, as http.ServeMux panics on a bad
// pattern: it is a programming error, found at start-up.
func (m *Middleware) Route(rt Route) func(http.Handler) http.Handler {
	if rt.Operation != "" {
		if err := inboxdb.ValidateConsumer(rt.Operation); err != nil {
			panic(fmt.Sprintf("httpidem: Route.Operation %q: %v", rt.Operation, err))
		}
		for _, e := range m.parts.Parts() {
			e.metrics.op(rt.Operation) // every shard's series, under its name
		}
	}
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { m.serve(rt, next, w, r) })
	}
}

// serve is one request's walk: read it (its tenant's part, operation, key, body
// and fingerprint), claim its key (or, without a key, begin its transaction), run
// the handler, settle (store the response and commit, or roll back and record),
// and answer. Every step records its answer in q when the request goes no
// further; the answer is written once, at the end, after the connection went back
// to the pool.
func (m *Middleware) serve(rt Route, next http.Handler, w http.ResponseWriter, r *http.Request) {
	if safeMethod(r.Method) && !rt.SafeMethods {
		next.ServeHTTP(w, r) // a read: nothing to run once, and a stored one would be replayed stale
		return
	}
	q := &request{w: w, r: r, next: next}
	defer q.release()
	if e := m.read(rt, q); e != nil && e.claim(q) {
		e.run(q)
		e.settle(q)
	}
	q.answer()
}

// errEmptyTenant: Config.Tenant returned "", which would put the request's key in
// the unscoped space that Unscoped opts into.
var errEmptyTenant = errors.New("Config.Tenant returned an empty tenant")

// read reads what q is and returns the part that runs it: the tenant (which, with
// a shard map, picks the part), the operation, the key, and for a keyed request
// the body and its fingerprint. It returns nil, with the answer recorded, for a
// request refused before anything runs (400, 413, 500). A request whose tenant
// cannot be read goes to the first part, which refuses it if it has a key.
func (m *Middleware) read(rt Route, q *request) *engine {
	r := q.r
	var tenant string
	var terr error
	if m.cfg.Tenant != nil {
		tenant, terr = m.cfg.Tenant(r)
		if terr == nil && tenant == "" {
			terr = errEmptyTenant
		}
		if terr == nil {
			terr = inboxdb.ValidateTenant(tenant)
		}
	}
	i := 0
	if terr == nil {
		var err error
		if i, err = m.parts.Index(tenant); err != nil {
			m.log.Error("idem: no shard for the request's tenant", "tenant", tenant, "err", err)
			q.fail("", CodeShardRoute, "the server has no shard for this tenant; nothing was run", 0)
			return nil
		}
	}
	e := m.parts.Part(i)
	q.e = e

	op := rt.Operation
	if op == "" {
		var err error
		if op, err = m.cfg.Operation(r); err == nil {
			err = inboxdb.ValidateConsumer(op)
		}
		if err != nil {
			m.log.Error("idem: request without an operation; set Route.Operation or Config.Operation", "err", err, "method", r.Method, "path", r.URL.Path)
			q.fail("", CodeNoOperation, "the server cannot name this request's operation", 0)
			return nil
		}
	}
	e.metrics.op(op)
	q.claim.Consumer = op

	key, err := parseKey(r.Header.Values(m.cfg.KeyHeader))
	switch {
	case errors.Is(err, errKeyAbsent):
		if rt.KeyOptional || m.cfg.KeyOptional {
			q.mode = modeUnkeyed
			return e
		}
		q.fail(OutcomeRejected, CodeKeyMissing, "send an "+m.cfg.KeyHeader+" header: a unique value (a UUID) per operation, the same on every retry of it", 0)
		return nil
	case err != nil:
		q.fail(OutcomeRejected, CodeKeyInvalid, err.Error(), 0)
		return nil
	}
	q.claim.Key, q.claim.Retention = key, m.cfg.Retention
	if terr != nil {
		m.log.Info("idem: tenant refused", append(q.attrs(), "err", terr)...)
		q.fail(OutcomeRejected, CodeTenantInvalid, "the request's tenant could not be determined", 0)
		return nil
	}
	q.claim.Tenant = tenant
	if q.body, err = readBody(r, m.cfg.MaxRequestBody); err != nil {
		if errors.Is(err, errBodyTooLarge) {
			q.fail(OutcomeRejected, CodeRequestTooLarge, fmt.Sprintf("the body is over %d bytes; nothing was run", m.cfg.MaxRequestBody), 0)
		} else {
			q.fail(OutcomeRejected, CodeBodyUnreadable, "the request body could not be read", 0)
		}
		return nil
	}
	if m.cfg.Fingerprint != nil {
		q.claim.Fingerprint, err = m.cfg.Fingerprint(fingerprintView(r, m.cfg.KeyHeader), q.body)
		if err != nil {
			m.log.Info("idem: fingerprint failed", append(q.attrs(), "err", err)...)
			q.fail(OutcomeRejected, CodeFingerprintFailed, "the request cannot be fingerprinted", 0)
			return nil
		}
	} else if q.claim.Fingerprint, err = m.fingerprint(r, q.body); err != nil {
		q.fail(OutcomeRejected, CodeBodyNotJSON, err.Error(), 0)
		return nil
	}
	q.mode = modeTx
	if rt.Lease {
		q.mode = modeLease
	}
	return e
}
