package chaos

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/idem/internal/errcode"
)

// PublisherConfig says how often a Publisher sends a message twice.
type PublisherConfig struct {
	// Seed makes the choice deterministic for a given order of messages.
	Seed int64
	// DuplicateProbability is the chance that a message is published a second
	// time, right after the first, with the same UUID, payload and metadata: a
	// producer that retried a send whose acknowledgement it never saw.
	DuplicateProbability float64
}

// WithDefaults returns c: no field has a default other than its zero value. It is
// here so that every idem config has the same methods.
func (c PublisherConfig) WithDefaults() PublisherConfig { return c }

// Validate reports what NewPublisher would refuse in c.
func (c PublisherConfig) Validate() error {
	return validProbability("DuplicateProbability", c.DuplicateProbability)
}

// Publisher wraps a message.Publisher and publishes a fraction of the messages
// twice, as a retrying producer does.
type Publisher struct {
	pub message.Publisher
	cfg PublisherConfig

	mu  sync.Mutex
	rng *rand.Rand

	published, duplicates atomic.Int64
}

var _ message.Publisher = (*Publisher)(nil)

// NewPublisher wraps pub.
func NewPublisher(pub message.Publisher, cfg PublisherConfig) (*Publisher, error) {
	if pub == nil {
		return nil, fmt.Errorf("invalid config: %w", errcode.InvalidConfig("nil publisher"))
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	return &Publisher{pub: pub, cfg: cfg, rng: rand.New(rand.NewPCG(uint64(cfg.Seed), 0x9e3779b97f4a7c15))}, nil
}

// PublisherDecorator returns a message.PublisherDecorator, for places that take one.
func PublisherDecorator(cfg PublisherConfig) message.PublisherDecorator {
	return func(pub message.Publisher) (message.Publisher, error) { return NewPublisher(pub, cfg) }
}

// Publish publishes messages, each followed by a second copy when chosen. The
// copies are separate messages, so the underlying publisher may treat them as it
// treats any message.
func (p *Publisher) Publish(topic string, messages ...*message.Message) error {
	out := make([]*message.Message, 0, len(messages))
	p.mu.Lock()
	for _, m := range messages {
		out = append(out, m)
		if p.rng.Float64() < p.cfg.DuplicateProbability {
			c := message.NewMessage(m.UUID, slices.Clone(m.Payload))
			for k, v := range m.Metadata {
				c.Metadata.Set(k, v)
			}
			c.SetContext(m.Context())
			out = append(out, c)
		}
	}
	p.mu.Unlock()
	if err := p.pub.Publish(topic, out...); err != nil {
		return err
	}
	p.published.Add(int64(len(messages)))
	p.duplicates.Add(int64(len(out) - len(messages)))
	return nil
}

// Published is how many messages the caller published (not counting copies).
func (p *Publisher) Published() int64 { return p.published.Load() }

// Duplicates is how many extra copies were published.
func (p *Publisher) Duplicates() int64 { return p.duplicates.Load() }

// Close closes the underlying publisher.
func (p *Publisher) Close() error { return p.pub.Close() }
