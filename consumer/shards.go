package consumer

import (
	"cmp"
	"errors"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/idem/internal/fanout"
	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/schemacheck"
	"github.com/idemkit/idem/shard"
)

// shards is a Consumer's shard map: one single-database Consumer a shard, in map
// order. The sharded Consumer only routes: a message's tenant picks its shard's
// Consumer before anything else, and that Consumer claims, runs and commits it as
// it would alone, in a transaction on its shard. Each shard's Consumer has its own
// group-commit and batch workers, so a batch only ever holds one shard's messages,
// and one shard down nacks only its own (ErrDatabaseUnavailable) while the others
// commit.
type shards struct {
	m      *shard.Map
	each   []*Consumer
	tenant KeyFunc
	// defaultTenant is Config.DefaultTenant, the tenant of a message without one.
	defaultTenant string
}

// newSharded builds one Consumer a shard, each with its own Prometheus series,
// labelled with its shard's name. cfg has its defaults; defaultFP says that its
// Fingerprint is the default one, which each shard's Consumer then computes
// without an allocation.
func newSharded(cfg Config, defaultFP bool) (*Consumer, error) {
	part := cfg
	if defaultFP {
		part.Fingerprint = nil
	}
	each, err := shard.Each(cfg.Shards, part.forShard, New)
	if err != nil {
		return nil, err
	}
	for _, c := range each {
		c.sharded = true
	}
	s := &shards{m: cfg.Shards, tenant: cfg.Tenant, defaultTenant: cfg.DefaultTenant, each: each}
	return &Consumer{cfg: cfg, shards: s, log: cfg.Logger}, nil
}

// schemaTargets are the databases New checks at start: every shard, or Pool and
// Schema.
func (c Config) schemaTargets() []schemacheck.Target {
	return fanout.SchemaTargets(c.Shards, c.Pool, c.Schema)
}

// forShard returns c for sh's part of a sharded Consumer: sh's database, and c's
// logger and registerer labelled with sh's name.
func (c Config) forShard(sh shard.Shard) Config {
	c.Shards, c.Pool, c.Schema = nil, sh.Pool, sh.SchemaName()
	c.SkipSchemaCheck = true // New checked every shard
	c.Logger, c.Registerer = sh.Label(c.Logger, c.Registerer)
	return c
}

// route returns the index of msg's shard. A message whose tenant cannot be read, or
// is invalid, or is empty without a DefaultTenant, goes to the first shard, whose
// Consumer refuses it (ErrTenantMissing for the empty one; nothing is claimed or
// recorded for it). A route that fails returns an error wrapping shard.ErrRoute.
func (s *shards) route(msg *message.Message) (int, error) {
	tenant, err := s.tenant(msg)
	tenant = cmp.Or(tenant, s.defaultTenant)
	if err != nil || tenant == "" || inboxdb.ValidateTenant(tenant) != nil {
		return 0, nil
	}
	return s.m.Index(tenant)
}

func (s *shards) middleware(h message.HandlerFunc) message.HandlerFunc {
	hs := make([]message.HandlerFunc, len(s.each))
	for i, c := range s.each {
		hs[i] = c.Middleware(h)
	}
	return func(msg *message.Message) ([]*message.Message, error) {
		i, err := s.route(msg)
		if err != nil {
			return nil, err
		}
		return hs[i](msg)
	}
}

func (s *shards) handleBatch(h BatchHandler) message.NoPublishHandlerFunc {
	hs := make([]message.NoPublishHandlerFunc, len(s.each))
	for i, c := range s.each {
		hs[i] = c.HandleBatch(h)
	}
	return func(msg *message.Message) error {
		i, err := s.route(msg)
		if err != nil {
			return err
		}
		return hs[i](msg)
	}
}

func (s *shards) close() error {
	var errs []error
	for _, c := range s.each {
		errs = append(errs, c.Close())
	}
	return errors.Join(errs...)
}
