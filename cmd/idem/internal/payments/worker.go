package payments

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem/chaos"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/shard"
)

// ConsumerConfig is one consumer instance of the scenario.
type ConsumerConfig struct {
	Pool *pgxpool.Pool
	// Schema holds the idem tables and the ledger; with Shards, the ledger's
	// schema on every shard.
	Schema string
	// Shards, in place of Pool, spreads the payments over several databases by
	// their tenant (the TenantMetadata field): each payment's ledger row, inbox
	// row and effect commit on its tenant's shard. Not with Peer.
	Shards *shard.Map
	// ByTenant, with Pool, gives each payment its tenant (the TenantMetadata
	// field) on the one database: on Citus, its inbox row, ledger row and effect
	// commit on the worker that holds the tenant. Shards implies it. Not with
	// Peer.
	ByTenant   bool
	Subscriber message.Subscriber
	// Topic to consume (default Topic).
	Topic string
	// Peer replaces idem with Watermill's in-memory middleware.Deduplicator, and
	// effects with a direct send through PeerSender.
	Peer       bool
	PeerSender effects.Sender
	// Registerer gets idem's metrics (nil: none).
	Registerer prometheus.Registerer
	Logger     *slog.Logger
	// Mode is how idem runs the payment handler: Transactional (the default),
	// GroupCommit (the per-message Handler, batched on the set-based path), or
	// Batch (BatchHandler through consumer.HandleBatch). Peer ignores it.
	Mode Mode
	// OnReceive, if set, is called once for each delivery before the handler
	// chain runs: a delivery counted there reached the consumer, whatever
	// happens to its process next.
	OnReceive func()
	// OnDelivery, if set, is called once for each delivery after the handler
	// chain returned, before the ack: ran says whether the payment handler ran
	// (false for a copy that idem or the Deduplicator suppressed), err is what
	// the chain returned (nil: acked).
	OnDelivery func(ran bool, err error)
}

// Mode is how idem runs the payment handler; see ConsumerConfig.Mode.
type Mode string

// The modes of ConsumerConfig.Mode.
const (
	Transactional Mode = ""
	GroupCommit   Mode = "group-commit"
	Batch         Mode = "batch"
)

// batchSize is MaxBatch in GroupCommit and Batch mode: what a subscriber that
// feeds batches (ConnectBatched) holds in flight, spread over two workers.
const batchSize = 32

// ranKey marks, in a delivery's context, that the payment handler ran for it.
type ranKey struct{}

// markRan wraps the payment handler so that OnDelivery can tell a handled
// delivery from a suppressed one.
func markRan(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		if ran, ok := msg.Context().Value(ranKey{}).(*bool); ok {
			*ran = true
		}
		return h(msg)
	}
}

// RunConsumer handles payments from cfg.Subscriber until ctx ends. The chaos
// crash middleware sits outermost, so an armed after-commit-before-ack point kills
// the process between idem's commit and the ack.
func RunConsumer(ctx context.Context, cfg ConsumerConfig) error {
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NewSlogLogger(logger))
	if err != nil {
		return err
	}
	var h message.HandlerFunc
	if cfg.Peer {
		if cfg.Shards != nil || cfg.ByTenant {
			return errors.New("payments: the peer runs on one database without tenants, not on Shards or ByTenant")
		}
		repo, err := middleware.NewMapExpiringKeyRepository(time.Hour)
		if err != nil {
			return err
		}
		d := &middleware.Deduplicator{
			KeyFactory: func(m *message.Message) (string, error) { return m.UUID, nil },
			Repository: repo,
		}
		h = d.Middleware(markRan(PeerHandler(cfg.Pool, cfg.Schema, cfg.PeerSender)))
	} else {
		ccfg := consumer.Config{
			Name: Consumer, Pool: cfg.Pool, Schema: cfg.Schema,
			LockTimeout: 2 * time.Second, BusyDelay: 20 * time.Millisecond,
			Registerer: cfg.Registerer, Logger: cfg.Logger,
		}
		if cfg.Shards != nil || cfg.ByTenant {
			ccfg.Tenant = consumer.MetadataKey(TenantMetadata)
		}
		if cfg.Shards != nil {
			ccfg.Pool, ccfg.Schema, ccfg.Shards = nil, "", cfg.Shards
		}
		switch cfg.Mode {
		case Transactional:
		case GroupCommit:
			ccfg.Mode, ccfg.Batch.MaxBatch = consumer.GroupCommit, batchSize
		case Batch:
			ccfg.Batch.MaxBatch = batchSize
		default:
			return fmt.Errorf("unknown mode %q (want %q, %q or %q)", cfg.Mode, Transactional, GroupCommit, Batch)
		}
		c, err := consumer.New(ccfg)
		if err != nil {
			return err
		}
		defer func() { _ = c.Close() }()
		if cfg.Mode == Batch {
			bh := c.HandleBatch(BatchHandler(cfg.Schema))
			h = func(msg *message.Message) ([]*message.Message, error) { return nil, bh(msg) }
		} else {
			h = c.Middleware(markRan(Handler(cfg.Schema)))
		}
	}
	if cfg.OnDelivery != nil {
		inner := h
		h = func(msg *message.Message) ([]*message.Message, error) {
			ran := new(bool)
			msg.SetContext(context.WithValue(msg.Context(), ranKey{}, ran))
			out, err := inner(msg)
			cfg.OnDelivery(*ran, err)
			return out, err
		}
	}
	router.AddConsumerHandler(Consumer, cmp.Or(cfg.Topic, Topic), cfg.Subscriber, message.NoPublishHandlerFunc(func(msg *message.Message) error {
		if cfg.OnReceive != nil {
			cfg.OnReceive()
		}
		_, err := chaos.CrashMiddleware(h)(msg)
		return err
	}))
	return router.Run(ctx)
}

// NewDispatcher makes the email Dispatcher of the scenario. lease is short in a
// chaos run, so a send cut by a kill is retried soon.
func NewDispatcher(pool *pgxpool.Pool, schema, smtpAddr string, lease time.Duration, reg prometheus.Registerer, logger *slog.Logger) (*effects.Dispatcher, error) {
	cfg := dispatcherConfig(smtpAddr, lease, reg, logger)
	cfg.Pool, cfg.Schema = pool, schema
	return effects.NewDispatcher(cfg)
}

// NewShardedDispatcher is NewDispatcher over every shard of m: one claim loop,
// LISTEN connection and set of lanes a shard.
func NewShardedDispatcher(m *shard.Map, smtpAddr string, lease time.Duration, reg prometheus.Registerer, logger *slog.Logger) (*effects.Dispatcher, error) {
	cfg := dispatcherConfig(smtpAddr, lease, reg, logger)
	cfg.Shards = m
	return effects.NewDispatcher(cfg)
}

func dispatcherConfig(smtpAddr string, lease time.Duration, reg prometheus.Registerer, logger *slog.Logger) effects.Config {
	return effects.Config{
		Lease:        lease,
		Senders:      map[string]effects.Sender{EmailKind: &SMTPSender{Addr: smtpAddr}},
		Concurrency:  map[string]int{EmailKind: 4},
		Backoff:      effects.Backoff{Initial: 50 * time.Millisecond, Max: time.Second},
		PollInterval: 500 * time.Millisecond,
		Registerer:   reg, Logger: logger,
	}
}
