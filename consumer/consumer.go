package consumer

import (
	"cmp"
	"fmt"
	"log/slog"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/idem/internal/fanout"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/schemacheck"
	"github.com/idemkit/idem/shard"
)

// Consumer runs Watermill messages through the inbox. Use its Middleware on a
// router handler, or HandleBatch for a BatchHandler. It is safe for concurrent
// use.
//
// A Consumer is a front over one engine a database: the one database of Pool and
// Schema, or one a shard of Shards. Over a shard map, a message's tenant picks its
// shard's engine before anything else, and that engine claims, runs and commits
// it as it would alone, in a transaction on its shard. Each shard has its own
// group-commit and batch workers, so a batch only ever holds one shard's messages,
// and one shard down nacks only its own (ErrDatabaseUnavailable) while the others
// commit. With one database the front hands every message to its one engine
// without asking its tenant.
type Consumer struct {
	parts *fanout.Set[*engine]
	mode  Mode
	log   *slog.Logger
	// tenant and defaultTenant route a message over a shard map (Config.Tenant and
	// Config.DefaultTenant).
	tenant        KeyFunc
	defaultTenant string
}

// partConfig is the config of one engine: Config with its defaults, naming one
// database, and what the front decided for it.
type partConfig struct {
	Config
	// defaultFP: Fingerprint was unset, so the engine computes the payload's
	// SHA-256 into the request itself (no allocation).
	defaultFP bool
	// requireTenant: the engine is a shard's, so a message without a tenant is
	// refused (ErrTenantMissing).
	requireTenant bool
}

// New validates cfg, checks the schema once, and returns a Consumer.
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
func New(cfg Config) (*Consumer, error) {
	pc := partConfig{defaultFP: cfg.Fingerprint == nil}
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	cfg = cfg.WithDefaults()
	if err := schemacheck.Start(cfg.SkipSchemaCheck, cfg.Logger, cfg.schemaTargets()); err != nil {
		return nil, err
	}
	pc.Config = cfg
	parts, err := fanout.Build(cfg.Shards, pc, pc.forShard, newEngine)
	if err != nil {
		return nil, err
	}
	return &Consumer{parts: parts, mode: cfg.Mode, log: cfg.Logger, tenant: cfg.Tenant, defaultTenant: cfg.DefaultTenant}, nil
}

// schemaTargets are the databases New checks at start: every shard, or Pool and
// Schema.
func (c Config) schemaTargets() []schemacheck.Target {
	return fanout.SchemaTargets(c.Shards, c.Pool, c.Schema)
}

// forShard returns pc for sh's engine: sh's database, pc's logger and registerer
// labelled with sh's name, and a tenant required of every message.
func (pc partConfig) forShard(sh shard.Shard) partConfig {
	pc.Shards, pc.Pool, pc.Schema = nil, sh.Pool, sh.SchemaName()
	pc.SkipSchemaCheck = true // New checked every shard
	pc.Logger, pc.Registerer = fanout.Label(sh, pc.Logger, pc.Registerer)
	pc.requireTenant = true
	return pc
}

// Middleware is the Watermill handler middleware.
func (c *Consumer) Middleware(h message.HandlerFunc) message.HandlerFunc {
	if inner := innerMiddleware(h); inner != "" {
		return wrongOrderHandler(c.log, inner)
	}
	return fanout.Front(c.parts, func(e *engine) message.HandlerFunc { return e.middleware(h) },
		func(hs []message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				i, err := c.route(msg)
				if err != nil {
					return nil, err
				}
				return hs[i](msg)
			}
		})
}

// HandleBatch returns a Watermill handler that runs h on batches. Watermill hands a
// handler one message per call: each call joins a batch (the messages that arrive
// together, up to Batch.MaxBatch, waiting at most Batch.MaxWait for more;
// Batch.Workers batches run at once, whatever Mode says) and returns when its batch
// has committed, with the message's own answer. Put it in a router with
// AddConsumerHandler; Retry and PoisonQueue go outside it with AddMiddleware, as for
// the Middleware. A batch needs many messages in flight: many partitions, or a
// subscriber that delivers several messages of one partition at once.
//
// HandleBatch panics in Lease mode, which holds one message's key outside any
// transaction and has no batches.
func (c *Consumer) HandleBatch(h BatchHandler) message.NoPublishHandlerFunc {
	if h == nil {
		panic("idem: HandleBatch needs a BatchHandler")
	}
	if c.mode == Lease {
		panic("idem: HandleBatch needs Transactional or GroupCommit mode; Lease mode has no batches")
	}
	return fanout.Front(c.parts, func(e *engine) message.NoPublishHandlerFunc { return e.handleBatch(h) },
		func(hs []message.NoPublishHandlerFunc) message.NoPublishHandlerFunc {
			return func(msg *message.Message) error {
				i, err := c.route(msg)
				if err != nil {
					return err
				}
				return hs[i](msg)
			}
		})
}

// route returns the index of msg's shard. A message whose tenant cannot be read, or
// is invalid, or is empty without a DefaultTenant, goes to the first shard, whose
// engine refuses it (ErrTenantMissing for the empty one; nothing is claimed or
// recorded for it). A route that fails returns an error wrapping shard.ErrRoute.
func (c *Consumer) route(msg *message.Message) (int, error) {
	tenant, err := c.tenant(msg)
	tenant = cmp.Or(tenant, c.defaultTenant)
	if err != nil || tenant == "" || inboxdb.ValidateTenant(tenant) != nil {
		return 0, nil
	}
	return c.parts.Index(tenant)
}

// Close makes the consumer refuse new messages (they get ErrClosed and are nacked),
// waits for the messages in progress to finish, and stops the group-commit workers.
// It is safe to call at any time, from any goroutine, and more than once; it is
// final. Close the router first, so that no message is refused needlessly.
func (c *Consumer) Close() error {
	return c.parts.Each(func(_ int, e *engine) error { return e.close() })
}
