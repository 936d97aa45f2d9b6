package consumer

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/require"
)

// Watermill's middlewares that must be outside idem are named, as the router
// builds them (a method value) and as a direct call builds them (inlined into the
// caller); the others, and a bare handler, are not. A Watermill upgrade that
// renames these closures fails here.
func TestInnerMiddlewareNames(t *testing.T) {
	h := func(*message.Message) ([]*message.Message, error) { return nil, nil }
	pq, err := middleware.PoisonQueue(nil, "p")
	require.NoError(t, err)
	retry := middleware.Retry{}
	ignore := middleware.NewIgnoreErrors(nil)
	for want, mw := range map[string]message.HandlerMiddleware{
		"middleware.Retry":        retry.Middleware,
		"middleware.PoisonQueue":  pq,
		"middleware.IgnoreErrors": ignore.Middleware,
		"middleware.Duplicator":   middleware.Duplicator,
	} {
		require.Equal(t, want, innerMiddleware(mw(h)))
	}
	require.Equal(t, "middleware.Retry", innerMiddleware(retry.Middleware(h)))
	require.Equal(t, "middleware.IgnoreErrors", innerMiddleware(ignore.Middleware(h)))
	require.Equal(t, "", innerMiddleware(middleware.Recoverer(h)))
	require.Equal(t, "", innerMiddleware(middleware.Timeout(0)(h)))
	require.Equal(t, "", innerMiddleware(h))
}
