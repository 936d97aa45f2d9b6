package consumer_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/pgtest"
)

// BenchmarkMiddleware: one message at a time through the Transactional
// middleware, with a business row and one effect a message, on one database.
//
//	go test -run '^$' -bench Middleware -benchtime 3000x ./consumer
func BenchmarkMiddleware(b *testing.B) {
	pool, schema := pgtest.Setup(b, pgtest.Options{MaxConns: 4})
	_, err := pool.Exec(context.Background(), `CREATE TABLE biz (id bigserial PRIMARY KEY, key text NOT NULL)`)
	require.NoError(b, err)
	c, err := consumer.New(consumer.Config{Name: "bench", Pool: pool, Schema: schema})
	require.NoError(b, err)
	defer func() { require.NoError(b, c.Close()) }()
	h := c.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx := consumer.Tx(ctx)
		if _, err := tx.Exec(ctx, `INSERT INTO biz (key) VALUES ($1)`, msg.UUID); err != nil {
			return nil, err
		}
		_, err := effects.Enqueue(ctx, tx, effects.Effect{Kind: "email", Key: msg.UUID, Payload: msg.Payload})
		return nil, err
	})
	b.ResetTimer()
	for i := range b.N {
		if _, err := h(message.NewMessage(fmt.Sprintf("m-%d", i), []byte(`{}`))); err != nil {
			b.Fatal(err)
		}
	}
}
