package chaos

import (
	"cmp"
	"log/slog"
	"time"

	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/pgschema"
)

// Defaults of Config and AuditorConfig.
const (
	// DefaultSchema holds the idem tables unless AuditorConfig.Schema says
	// otherwise.
	DefaultSchema = pgschema.Default
	// DefaultSettlePoll is the time between the audits of Auditor.Settled.
	DefaultSettlePoll = 50 * time.Millisecond
	// DefaultSettleQuiet is how long Auditor.Settled waits for figures that stopped
	// changing before it takes the run as settled.
	DefaultSettleQuiet = 2 * time.Second
	// DefaultMaxCopies caps the extra copies of one message when duplicating.
	DefaultMaxCopies = 2
	// DefaultRedeliverDelay is how long after an ack a message is redelivered.
	DefaultRedeliverDelay = 50 * time.Millisecond
	// DefaultNackDelay is how long after a nack a copy is delivered again.
	DefaultNackDelay = 10 * time.Millisecond
	// DefaultReorderIdle is how long the reorder window waits for more messages
	// before it lets the held ones go, so a subscriber that sends one message at a
	// time and waits for its ack never stalls.
	DefaultReorderIdle = 5 * time.Millisecond
)

// Config says which faults a Subscriber injects. The zero Config injects none.
type Config struct {
	// Seed makes the run deterministic. Every decision about the n-th message
	// from the upstream subscriber (copies, redelivery, delays) comes from a
	// generator seeded with (Seed, n), so the same seed and the same upstream order
	// inject the same faults into the same messages. With several messages in
	// flight at once, when they reach the handler still depends on timing.
	Seed int64
	// DuplicateProbability is the chance that a message is delivered more than
	// once straight away: between 1 and MaxCopies extra copies, which arrive while
	// the original may still be in flight (as a producer retry or a rebalance
	// would cause).
	DuplicateProbability float64
	// MaxCopies caps the extra copies (default 2).
	MaxCopies int
	// RedeliverProbability is the chance that a message is delivered again after
	// its original was acked, as a broker does when it crashed before it stored
	// the ack (or a consumer group rebalanced before the offset commit).
	RedeliverProbability float64
	// RedeliverDelay is how long after the ack that redelivery comes (default
	// 50 ms).
	RedeliverDelay time.Duration
	// NackDelay is how long after a nack an injected copy is delivered again
	// (default 10 ms). Nacked originals go back to the upstream subscriber, which
	// redelivers them itself.
	NackDelay time.Duration
	// ReorderWindow, if above 1, holds up to that many messages and lets them go
	// in a shuffled order.
	ReorderWindow int
	// ReorderIdle is how long the window waits for the next message before it
	// releases what it holds (default 5 ms).
	ReorderIdle time.Duration
	// MaxDelay, if set, delays every delivery (originals and copies) by a random
	// time in [0, MaxDelay).
	MaxDelay time.Duration
	// Logger gets a debug line per injected fault (nil: quiet).
	Logger *slog.Logger
}

// WithDefaults returns c with every unset field at its default.
func (c Config) WithDefaults() Config {
	c.MaxCopies = cmp.Or(c.MaxCopies, DefaultMaxCopies)
	c.RedeliverDelay = cmp.Or(c.RedeliverDelay, DefaultRedeliverDelay)
	c.NackDelay = cmp.Or(c.NackDelay, DefaultNackDelay)
	c.ReorderIdle = cmp.Or(c.ReorderIdle, DefaultReorderIdle)
	c.Logger = cmp.Or(c.Logger, slog.New(slog.DiscardHandler))
	return c
}

// Validate reports what NewSubscriber would refuse in c. It checks
// c.WithDefaults(), so the zero Config (no faults) passes.
func (c Config) Validate() error {
	c = c.WithDefaults()
	if err := validProbability("DuplicateProbability", c.DuplicateProbability); err != nil {
		return err
	}
	if err := validProbability("RedeliverProbability", c.RedeliverProbability); err != nil {
		return err
	}
	switch {
	case c.MaxCopies < 1:
		return errcode.InvalidConfig("MaxCopies %d is under 1", c.MaxCopies)
	case c.RedeliverDelay < 0 || c.NackDelay < 0 || c.MaxDelay < 0 || c.ReorderIdle < 0:
		return errcode.InvalidConfig("delays must not be negative")
	case c.ReorderWindow < 0:
		return errcode.InvalidConfig("ReorderWindow %d is negative", c.ReorderWindow)
	}
	return nil
}

// validProbability refuses a probability outside [0, 1].
func validProbability(name string, p float64) error {
	if p < 0 || p > 1 {
		return errcode.InvalidConfig("%s %v is outside [0, 1]", name, p)
	}
	return nil
}
