package chaos

import (
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
)

// CrashPoint names a place in the life of a message or an effect where a test can
// make the process die.
type CrashPoint string

// The crash points, and the environment variables that arm them. Each point is a
// call to Crash at the place described; the CrashMiddleware makes the
// AfterCommitBeforeAck call for you.
const (
	// BeforeCommit: the handler has done its database work inside the consumer's
	// transaction and has not returned yet, so nothing is committed. Call
	// Crash(BeforeCommit) as the last statement of your handler. Expected after a
	// crash: no inbox row, no business row, no effect; the broker redelivers and
	// the next delivery does the work once. (In group-commit mode the shared
	// transaction also holds other messages' work; none of it is committed.)
	BeforeCommit CrashPoint = "before-commit"
	// AfterCommitBeforeAck: the idem middleware has committed the inbox row, the
	// business writes and the effects, and the message is not acked yet. The
	// CrashMiddleware, placed outside the idem middleware, fires it when the inner
	// handler returned nil. Expected: the redelivery is a duplicate, acked without
	// running the handler.
	AfterCommitBeforeAck CrashPoint = "after-commit-before-ack"
	// MidSend: a sender has called the outside world and has not recorded the
	// outcome. Call Crash(MidSend) in your Sender after the provider accepted the
	// send and before returning. Expected: the effect stays pending until its lease
	// ends, then is sent again with the same effect key.
	MidSend CrashPoint = "mid-send"

	// EnvCrash is the environment variable that arms crash points in a process:
	// a comma-separated list of point:trigger, where the trigger is a probability
	// ("after-commit-before-ack:0.05") or the n-th time the point is reached
	// ("before-commit:nth=3"). A point without a trigger fires the first time.
	EnvCrash = "IDEM_CHAOS_CRASH"
	// EnvCrashSeed seeds the probabilities of EnvCrash (default: random).
	EnvCrashSeed = "IDEM_CHAOS_SEED"
)

// crashPoints lists every crash point.
var crashPoints = []CrashPoint{BeforeCommit, AfterCommitBeforeAck, MidSend}

// trigger says when one armed point fires.
type trigger struct {
	prob float64 // > 0: fire with this probability at each hit
	nth  int64   // > 0: fire at the nth hit
	hits int64
}

// crasher holds armed crash points. The zero crasher has none armed. It is safe
// for concurrent use.
type crasher struct {
	mu    sync.Mutex
	armed map[CrashPoint]*trigger
	rng   *rand.Rand
	// kill ends the process; tests of the crasher itself replace it.
	kill func(CrashPoint)
}

// parseCrashSpec parses an EnvCrash value into a crasher that uses seed for its
// probabilities.
func parseCrashSpec(spec string, seed int64) (*crasher, error) {
	c := &crasher{armed: map[CrashPoint]*trigger{}, rng: rand.New(rand.NewPCG(uint64(seed), 0xc4a5))}
	for part := range strings.SplitSeq(spec, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		name, trig, _ := strings.Cut(part, ":")
		p := CrashPoint(strings.TrimSpace(name))
		if !p.valid() {
			return nil, fmt.Errorf("chaos: unknown crash point %q (known: %v)", name, crashPoints)
		}
		t := &trigger{nth: 1}
		trig = strings.TrimSpace(trig)
		switch {
		case trig == "":
		case strings.HasPrefix(trig, "nth="):
			n, err := strconv.ParseInt(strings.TrimPrefix(trig, "nth="), 10, 64)
			if err != nil || n < 1 {
				return nil, fmt.Errorf("chaos: crash point %s: bad nth %q", p, trig)
			}
			t.nth = n
		default:
			f, err := strconv.ParseFloat(trig, 64)
			if err != nil || f <= 0 || f > 1 {
				return nil, fmt.Errorf("chaos: crash point %s: probability %q is not in (0, 1]", p, trig)
			}
			t.prob, t.nth = f, 0
		}
		c.armed[p] = t
	}
	return c, nil
}

func (p CrashPoint) valid() bool {
	for _, q := range crashPoints {
		if p == q {
			return true
		}
	}
	return false
}

// Armed reports whether point is armed.
func (c *crasher) Armed(point CrashPoint) bool {
	if c == nil {
		return false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.armed[point] != nil
}

// Hit records that point was reached and reports whether it fires now, without
// crashing.
func (c *crasher) Hit(point CrashPoint) bool {
	if c == nil {
		return false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	t := c.armed[point]
	if t == nil {
		return false
	}
	t.hits++
	if t.prob > 0 {
		return c.rng.Float64() < t.prob
	}
	return t.hits == t.nth
}

// Crash kills the process with SIGKILL if point fires. It returns only if it does
// not fire.
func (c *crasher) Crash(point CrashPoint) {
	if !c.Hit(point) {
		return
	}
	if c.kill != nil {
		c.kill(point)
		return
	}
	killSelf(point)
}

// Middleware is a Watermill handler middleware that fires AfterCommitBeforeAck
// when the inner handler returns no error (see CrashMiddleware).
func (c *crasher) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		if err == nil {
			c.Crash(AfterCommitBeforeAck)
		}
		return out, err
	}
}

var (
	envOnce    sync.Once
	envCrasher *crasher
)

// fromEnv returns the crasher armed by EnvCrash and EnvCrashSeed, parsed once. A bad
// spec panics, so a test run with a typo dies loudly instead of never crashing.
func fromEnv() *crasher {
	envOnce.Do(func() {
		spec := os.Getenv(EnvCrash)
		seed := rand.Int64()
		if s := os.Getenv(EnvCrashSeed); s != "" {
			v, err := strconv.ParseInt(s, 10, 64)
			if err != nil {
				panic(fmt.Sprintf("chaos: %s=%q: %v", EnvCrashSeed, s, err))
			}
			seed = v
		}
		c, err := parseCrashSpec(spec, seed)
		if err != nil {
			panic(fmt.Sprintf("chaos: %s=%q: %v", EnvCrash, spec, err))
		}
		envCrasher = c
	})
	return envCrasher
}

// Crash kills the process with SIGKILL at point if EnvCrash armed it and its
// trigger fires; otherwise it returns at once. Unarmed, it costs one map look-up
// behind a mutex, so it can stay in code that also runs in production tests.
func Crash(point CrashPoint) { fromEnv().Crash(point) }

// CrashMiddleware is a Watermill handler middleware that fires AfterCommitBeforeAck,
// when EnvCrash armed it, as the inner handler returns no error. Add it outside
// the idem middleware (router.AddMiddleware(chaos.CrashMiddleware) before the
// consumer's), so that the inner handler's nil means "committed" and the router
// has not acked yet.
func CrashMiddleware(h message.HandlerFunc) message.HandlerFunc { return fromEnv().Middleware(h) }
