package consumer_test

import (
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/idemkit/idem/consumer"
)

// docMiddlewareOrder is the guide's snippet (docs/consumers.md) of the router
// middlewares around idem's, outermost first: compiled with the tests, not run.
// examples/quickstart/main.go sets the same order in addPaymentsHandler.
func docMiddlewareOrder(h *message.Handler, pub message.Publisher, idem *consumer.Consumer) {
	poison, _ := middleware.PoisonQueueWithFilter(pub, "payments.poison", consumer.IsPermanent)
	retry := middleware.Retry{MaxRetries: 5, InitialInterval: 100 * time.Millisecond,
		ShouldRetry: consumer.ShouldRetry}
	h.AddMiddleware(poison, retry.Middleware, idem.Middleware)
}

var _ = docMiddlewareOrder
