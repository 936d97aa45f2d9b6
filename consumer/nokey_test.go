package consumer_test

import (
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/inbox"
)

// A message without a key gets one error, whatever gave the empty key (the
// default Key on a message without a UUID, as the Kafka and NATS adapters
// deliver a record without their UUID header; or a KeyFunc such as
// MetadataKey on a message without its field): code empty_key, permanent, and
// a text that says what to configure. The middleware leaves the code and
// "permanent" on the message for the broker adapter; a transient error leaves
// no "permanent".
func TestNoKeyIsOneErrorThatSaysWhatToConfigure(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, mode consumer.Mode) {
		byUUID, b := setup(t, mode)
		byField, _ := setup(t, mode, func(cfg *consumer.Config) { cfg.Key = consumer.MetadataKey("order_id") })
		var texts []string
		for _, c := range []*consumer.Consumer{byUUID, byField} {
			msg := newMsg("", `{"amount": 10}`)
			_, err := c.Middleware(b.bizHandler(nil))(msg)
			require.ErrorIs(t, err, consumer.ErrEmptyKey)
			require.Equal(t, "empty_key", inbox.Code(err))
			require.True(t, consumer.IsPermanent(err))
			for _, want := range []string{"idem: empty idempotency key", "Config.Key", "consumer.BusinessKey",
				"consumer.MetadataKey", "kafka.PartitionOffsetKey", "Nats-Msg-Id", "_watermill_message_uuid", "middleware.PoisonQueue"} {
				require.Contains(t, err.Error(), want)
			}
			require.Equal(t, "empty_key", msg.Metadata.Get(consumer.MetadataErrorCode))
			require.Equal(t, "true", msg.Metadata.Get(consumer.MetadataErrorPermanent))
			texts = append(texts, err.Error())
		}
		require.Equal(t, texts[0], texts[1], "one text for the one mistake")
		require.EqualValues(t, 0, b.calls.Load())

		// A transient error: its code, and no "permanent".
		msg := newMsg(consumer.NewUUID(), `{}`)
		_, err := byUUID.Middleware(b.bizHandler(func(*message.Message) error { return errors.New("downstream unavailable") }))(msg)
		require.Error(t, err)
		require.Equal(t, "transient", msg.Metadata.Get(consumer.MetadataErrorCode))
		require.Empty(t, msg.Metadata.Get(consumer.MetadataErrorPermanent))
	})
}
