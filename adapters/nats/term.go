package nats

import (
	"context"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill/message"
)

// termKey is the context key under which the Subscriber puts a message's
// termination flag.
type termKey struct{}

// Term marks msg, delivered by a Subscriber, as a permanent failure. When the
// handler then nacks it (returns an error, under Watermill's router), the
// subscriber calls Term instead of NakWithDelay, and JetStream never delivers it
// again. An ack still acks. Term reports whether msg came from a Subscriber; it
// does nothing to any other message.
//
// Term is how a poison flow ends a message on NATS without an extra stream:
// idem's consumer records the failure in the inbox, and a hook calls Term.
// It works through msg.Context(), so a middleware that derives a new context
// from the message's own keeps it working.
func Term(msg *message.Message) bool {
	f, ok := msg.Context().Value(termKey{}).(*atomic.Bool)
	if ok {
		f.Store(true)
	}
	return ok
}

func withTermFlag(ctx context.Context) (context.Context, *atomic.Bool) {
	f := new(atomic.Bool)
	return context.WithValue(ctx, termKey{}, f), f
}
