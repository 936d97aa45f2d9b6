package nats

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/nats-io/nats.go/jetstream"
)

// ensureStream creates the stream if it is missing. An existing stream is left
// as it is, whatever its config: streams are shared by every publisher and
// consumer of their subjects, and one service's template must not rewrite
// another's limits. It must hold the subject, or publishing would go nowhere.
func ensureStream(ctx context.Context, js jetstream.JetStream, cfg jetstream.StreamConfig, logger watermill.LoggerAdapter) error {
	_, err := js.CreateStream(ctx, cfg)
	if err == nil {
		logger.Info("Created stream", watermill.LogFields{"stream": cfg.Name, "subjects": cfg.Subjects})
		return nil
	}
	if !errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
		return fmt.Errorf("create stream %s: %w", cfg.Name, err)
	}
	s, err := js.Stream(ctx, cfg.Name)
	if err != nil {
		return fmt.Errorf("look up stream %s: %w", cfg.Name, err)
	}
	// A wildcard in the existing stream can hold the subject too; the server
	// is the judge of that, so only an exact miss on a wildcard-free stream
	// is reported here.
	subjects := s.CachedInfo().Config.Subjects
	if !slices.Contains(subjects, cfg.Subjects[0]) && !hasWildcard(subjects) {
		return fmt.Errorf("stream %s exists with subjects %v, which do not include %s", cfg.Name, subjects, cfg.Subjects[0])
	}
	return nil
}

func hasWildcard(subjects []string) bool {
	for _, s := range subjects {
		for _, c := range s {
			if c == '*' || c == '>' {
				return true
			}
		}
	}
	return false
}

// ensureConsumer creates the durable consumer, or updates an existing one to
// cfg. This config wins on every server version: nats-server 2.9 updates a
// durable when it is created again with a different config, and 2.10 and later
// do the same for a create-or-update request (the request carries no action),
// while a plain create would fail there with "consumer already exists". The
// server refuses changes it cannot apply in place (AckPolicy, DeliverPolicy,
// the filter on 2.9 ...); that error is returned as it is.
func ensureConsumer(ctx context.Context, js jetstream.JetStream, stream string, cfg jetstream.ConsumerConfig) (jetstream.Consumer, error) {
	c, err := js.CreateOrUpdateConsumer(ctx, stream, cfg)
	if err != nil {
		return nil, fmt.Errorf("create or update consumer %s on stream %s: %w", cfg.Durable, stream, err)
	}
	return c, nil
}
