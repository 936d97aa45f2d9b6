package consumer

import (
	"log/slog"
	"reflect"
	"regexp"
	"runtime"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
)

// The middleware order. idem runs the handler once, in one transaction, and commits
// it when the handler returns nil. A middleware between idem and the handler that
// calls the handler again (middleware.Retry, middleware.Duplicator) runs every call
// in that one transaction, so a failed attempt's writes commit with the next one's;
// one that turns a failure into nil (middleware.PoisonQueue, IgnoreErrors) makes
// idem commit the failed handler's partial writes and record the key as done. Both
// belong outside idem.
//
// idem cannot wrap each attempt in a savepoint, since it never sees the attempts:
// the middleware below it calls the handler itself. So it refuses the order
// instead, two ways:
//
//   - Middleware(h) names the function it wraps (runtime.FuncForPC). Watermill's
//     Retry, PoisonQueue, IgnoreErrors and Duplicator return closures whose names
//     end in "<type>.Middleware.funcN" (or "Duplicator.funcN"), with the
//     middleware package's path, or the caller's when the constructor was inlined.
//     One of them directly inside idem refuses every message (wrongOrderHandler).
//   - Behind other middlewares the name is hidden, but PoisonQueue leaves its mark
//     on the message (middleware.ReasonForPoisonedKey) before it swallows the
//     error: a handler that returns nil with that mark newly set is refused, and
//     its transaction rolled back (poisonedInside).
//
// The refusal is ErrMiddlewareOrder, transient: the message is nacked, never acked
// as done and never recorded, so once the order is fixed it runs.
var wrongInside = regexp.MustCompile(`(^|\.)(Retry\.Middleware|poisonQueue\.Middleware|IgnoreErrors\.Middleware|Duplicator)\.func\d+$`)

// innerMiddleware returns the Watermill middleware that h is, by its function's
// name, or "" when h is none of those that must not sit inside idem.
func innerMiddleware(h message.HandlerFunc) string {
	if h == nil {
		return ""
	}
	fn := runtime.FuncForPC(reflect.ValueOf(h).Pointer())
	if fn == nil {
		return ""
	}
	m := wrongInside.FindStringSubmatch(fn.Name())
	if m == nil {
		return ""
	}
	switch m[2] {
	case "Retry.Middleware":
		return "middleware.Retry"
	case "poisonQueue.Middleware":
		return "middleware.PoisonQueue"
	case "IgnoreErrors.Middleware":
		return "middleware.IgnoreErrors"
	}
	return "middleware.Duplicator"
}

// wrongOrderHandler is the handler idem's Middleware returns around inner, a
// middleware that must be outside idem: it refuses every message with
// ErrMiddlewareOrder, and logs the fix once at error level.
func wrongOrderHandler(log *slog.Logger, inner string) message.HandlerFunc {
	var once sync.Once
	err := orderError(inner)
	return func(msg *message.Message) ([]*message.Message, error) {
		once.Do(func() {
			log.Error("idem: "+inner+" is inside idem's middleware; every message is refused (nacked, nothing run) until it is outside",
				"handler", message.HandlerNameFromCtx(msg.Context()), "code", ErrMiddlewareOrder.Code(), "err", err)
		})
		markErrorCode(msg, err)
		return nil, err
	}
}

// orderError is ErrMiddlewareOrder naming the middleware found inside idem.
func orderError(inner string) error {
	return &orderErr{inner: inner}
}

type orderErr struct{ inner string }

func (e *orderErr) Error() string {
	return ErrMiddlewareOrder.Error() + ": " + e.inner + " runs between idem and the handler"
}

func (e *orderErr) Unwrap() error { return ErrMiddlewareOrder }

// poisonMark is what middleware.PoisonQueue writes on a message it poisons.
func poisonMark(msg *message.Message) [4]string {
	return [4]string{
		msg.Metadata.Get(middleware.ReasonForPoisonedKey), msg.Metadata.Get(middleware.PoisonedTopicKey),
		msg.Metadata.Get(middleware.PoisonedHandlerKey), msg.Metadata.Get(middleware.PoisonedSubscriberKey),
	}
}

// poisonedInside is the error of a handler that returned nil for a message that a
// PoisonQueue between idem and the handler poisoned while it ran (its mark changed
// from before): the handler failed, so its writes must not commit. It logs the fix
// once at error level.
func (c *engine) poisonedInside(req *request) error {
	err := orderError("middleware.PoisonQueue (behind other middlewares)")
	c.orderOnce.Do(func() {
		c.log.Error("idem: a PoisonQueue inside idem's middleware poisoned a message and returned nil; its writes are rolled back and the message is nacked (the poison topic has a copy). Put the PoisonQueue outside idem",
			append(req.attrs(), "code", ErrMiddlewareOrder.Code(), "err", err)...)
	})
	return err
}
