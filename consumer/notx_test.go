package consumer_test

import (
	"context"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/inbox"
)

// Outside idem's middleware Tx panics with ErrNoTx, whose text names the mistake
// and the fix, and TxSafely returns it; inside, both give the message's
// transaction, which commits the handler's row.
func TestTxOutsideMiddleware(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tx, err := consumer.TxSafely(ctx)
	require.Nil(t, tx)
	require.ErrorIs(t, err, consumer.ErrNoTx)
	require.Equal(t, "no_transaction", inbox.Code(err))
	require.False(t, consumer.IsPermanent(err))
	require.Contains(t, err.Error(), "Middleware is not around this handler")
	require.Contains(t, err.Error(), "add c.Middleware last in AddMiddleware")

	var got any
	func() {
		defer func() { got = recover() }()
		_ = consumer.Tx(ctx)
	}()
	perr, ok := got.(error)
	require.True(t, ok, "Tx panics with an error, not %T", got)
	require.ErrorIs(t, perr, consumer.ErrNoTx)

	// A handler that forgot the middleware: its error (through TxSafely) is
	// coded, and nothing is written.
	_, b := setup(t, consumer.Transactional)
	_, err = b.bizHandler(nil)(message.NewMessage("k-1", []byte(`{}`)))
	require.True(t, errors.Is(err, consumer.ErrNoTx))
	require.Equal(t, 0, b.bizRows(t, "k-1"))

	// Inside the middleware both give the transaction, and its row commits.
	c, b := setup(t, consumer.Transactional)
	var same bool
	h := c.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, err := consumer.TxSafely(msg.Context())
		if err != nil {
			return nil, err
		}
		same = tx == consumer.Tx(msg.Context())
		_, err = tx.Exec(msg.Context(), `INSERT INTO biz (key) VALUES ($1)`, msg.UUID)
		return nil, err
	})
	_, err = h(message.NewMessage("k-2", []byte(`{}`)))
	require.NoError(t, err)
	require.True(t, same)
	require.Equal(t, 1, b.bizRows(t, "k-2"))
}
