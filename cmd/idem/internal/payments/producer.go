package payments

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/adapters/nats"
)

// natsProducer is the publisher of a NATS Conn. JetStream drops a second publish
// of a Nats-Msg-Id within the stream's duplicate window (2 min), so a producer's
// retries sent through the adapter, which writes every message's UUID as its
// Nats-Msg-Id, never reach a consumer: a chaos run would test the server's
// deduplication, not idem's. So every other message whose UUID this publisher has
// already published (a retry) goes out without Nats-Msg-Id, its UUID in
// nats.WatermillUUIDHeader only, as watermill-nats publishes by default. The
// server stores it as a message of its own, and the subscriber hands it on with
// the same UUID: a duplicate only idem can recognise. The other retries keep their
// Nats-Msg-Id, and the server drops them.
type natsProducer struct {
	*nats.Publisher
	js jetstream.JetStream

	mu      sync.Mutex
	seen    map[string]bool
	retries int

	pastWindow atomic.Int64
}

func newNATSProducer(nc *natsgo.Conn, pub *nats.Publisher) (*natsProducer, error) {
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, err
	}
	return &natsProducer{Publisher: pub, js: js, seen: map[string]bool{}}, nil
}

// Publish publishes msgs through the adapter, then the retries chosen to go
// without Nats-Msg-Id straight to topic's subject (the stream exists by then: the
// adapter provisions it on its first publish).
func (p *natsProducer) Publish(topic string, msgs ...*message.Message) error {
	var withID, without []*message.Message
	p.mu.Lock()
	for _, m := range msgs {
		if p.seen[m.UUID] {
			p.retries++
			if p.retries%2 == 1 {
				without = append(without, m)
				continue
			}
		}
		p.seen[m.UUID] = true
		withID = append(withID, m)
	}
	p.mu.Unlock()
	if len(withID) > 0 {
		if err := p.Publisher.Publish(topic, withID...); err != nil {
			return err
		}
	}
	if len(without) == 0 {
		return nil
	}
	futures := make([]jetstream.PubAckFuture, 0, len(without))
	for _, m := range without {
		h := natsgo.Header{nats.WatermillUUIDHeader: []string{m.UUID}}
		for k, v := range m.Metadata {
			h.Set(k, v)
		}
		f, err := p.js.PublishMsgAsync(&natsgo.Msg{Subject: topic, Header: h, Data: m.Payload})
		if err != nil {
			return fmt.Errorf("publish %s without Nats-Msg-Id to %s: %w", m.UUID, topic, err)
		}
		futures = append(futures, f)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var errs []error
	for i, f := range futures {
		select {
		case <-f.Ok():
			p.pastWindow.Add(1)
		case err := <-f.Err():
			errs = append(errs, fmt.Errorf("publish %s without Nats-Msg-Id to %s: %w", without[i].UUID, topic, err))
		case <-ctx.Done():
			return errors.Join(append(errs, fmt.Errorf("publish without Nats-Msg-Id to %s: %w", topic, ctx.Err()))...)
		}
	}
	return errors.Join(errs...)
}
