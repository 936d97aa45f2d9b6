package nats

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	natsgo "github.com/nats-io/nats.go"
)

// maxDeliverHookTimeout bounds one OnMaxDeliver call.
const maxDeliverHookTimeout = 30 * time.Second

// MaxDelivered describes a message that reached the consumer's MaxDeliver
// without an ack. JetStream will not deliver it to this consumer again. It is
// still in the stream while the stream's retention keeps it, at StreamSeq.
type MaxDelivered struct {
	// Message is the message as stored, with the delivery metadata of its last
	// delivery when Source is MaxDeliveredByNack. It is nil when the stream no
	// longer held the message by the time the advisory was handled.
	Message    *message.Message
	Stream     string
	Consumer   string
	StreamSeq  uint64
	Deliveries uint64
	Source     string // MaxDeliveredByNack or MaxDeliveredByAdvisory
}

// maxDeliveredFound logs, counts and hands a message on to OnMaxDeliver.
func (sub *subscription) maxDeliveredFound(d MaxDelivered) {
	sub.s.maxDelivered.Add(1)
	fields := sub.logFields().Add(watermill.LogFields{
		"stream_seq": d.StreamSeq,
		"deliveries": d.Deliveries,
		"source":     d.Source,
	})
	if d.Message != nil {
		fields = fields.Add(watermill.LogFields{"uuid": d.Message.UUID})
	}
	sub.s.logger.Error("Message reached MaxDeliver; JetStream will not deliver it again", nil, fields)
	if sub.s.cfg.OnMaxDeliver == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(sub.ctx), maxDeliverHookTimeout)
	defer cancel()
	if err := sub.s.cfg.OnMaxDeliver(ctx, d); err != nil {
		sub.s.hookErrors.Add(1)
		sub.s.logger.Error("OnMaxDeliver failed; the message is left in the stream at its sequence", err, fields)
	}
}

// maxDeliveriesAdvisory is the part of the server's
// io.nats.jetstream.advisory.v1.max_deliver event that is used here.
type maxDeliveriesAdvisory struct {
	Stream     string `json:"stream"`
	Consumer   string `json:"consumer"`
	StreamSeq  uint64 `json:"stream_seq"`
	Deliveries uint64 `json:"deliveries"`
}

// watchAdvisories handles MAX_DELIVERIES advisories for the consumer. The
// server raises one when a message's last delivery runs out its AckWait (a
// crashed handler, a message lost in a pull that nobody read). A last delivery
// that a handler nacks is terminated by lastDeliveryFailed instead, so it raises
// none. Advisories are core NATS messages: one raised while no instance of the
// durable is connected is lost, and the log line of the instance that crashed
// is all that is left. That is why the nack path does not rely on them.
func (sub *subscription) watchAdvisories() {
	defer sub.handlers.Done()
	defer func() {
		if err := sub.advSub.Unsubscribe(); err != nil && !errors.Is(err, natsgo.ErrConnectionClosed) {
			sub.s.logger.Debug("Unsubscribe from advisories failed", sub.logFields().Add(watermill.LogFields{"err": err.Error()}))
		}
	}()
	for {
		select {
		case m := <-sub.advisories:
			sub.handleAdvisory(m)
		case <-sub.ctx.Done():
			return
		}
	}
}

func (sub *subscription) handleAdvisory(m *natsgo.Msg) {
	var a maxDeliveriesAdvisory
	if err := json.Unmarshal(m.Data, &a); err != nil {
		sub.s.logger.Error("Unreadable MAX_DELIVERIES advisory", err, sub.logFields())
		return
	}
	d := MaxDelivered{
		Stream:     a.Stream,
		Consumer:   a.Consumer,
		StreamSeq:  a.StreamSeq,
		Deliveries: a.Deliveries,
		Source:     MaxDeliveredByAdvisory,
	}
	ctx, cancel := context.WithTimeout(sub.ctx, sub.s.cfg.AckTimeout)
	defer cancel()
	msg, err := sub.storedMessage(ctx, a.Stream, a.StreamSeq)
	if err != nil {
		sub.s.logger.Error("Cannot read the message that reached MaxDeliver", err,
			sub.logFields().Add(watermill.LogFields{"stream_seq": a.StreamSeq}))
	}
	d.Message = msg
	sub.maxDeliveredFound(d)
}

func (sub *subscription) storedMessage(ctx context.Context, stream string, seq uint64) (*message.Message, error) {
	s, err := sub.s.js.Stream(ctx, stream)
	if err != nil {
		return nil, err
	}
	raw, err := s.GetMsg(ctx, seq)
	if err != nil {
		return nil, err
	}
	msg := fromNatsMsg(raw.Subject, raw.Header, raw.Data)
	msg.Metadata[MetadataStream] = stream
	msg.Metadata[MetadataConsumer] = sub.consumer
	msg.Metadata[MetadataStreamSeq] = strconv.FormatUint(seq, 10)
	msg.Metadata[MetadataTimestamp] = raw.Time.UTC().Format(time.RFC3339Nano)
	return msg, nil
}

// PublishDeadLetter returns an OnMaxDeliver hook that publishes the message to
// topic through pub, keeping its UUID. Through a Publisher of this package that
// makes a second hook call for the same message a duplicate the dead-letter
// stream drops, within its duplicate window. The delivery metadata is kept
// under "dead_letter_*" keys, since pub drops the nats_* ones.
func PublishDeadLetter(pub message.Publisher, topic string) func(context.Context, MaxDelivered) error {
	return func(ctx context.Context, d MaxDelivered) error {
		if d.Message == nil {
			return fmt.Errorf("stream %s no longer holds sequence %d", d.Stream, d.StreamSeq)
		}
		msg := d.Message.Copy()
		msg.SetContext(ctx)
		msg.Metadata["dead_letter_stream"] = d.Stream
		msg.Metadata["dead_letter_consumer"] = d.Consumer
		msg.Metadata["dead_letter_stream_seq"] = strconv.FormatUint(d.StreamSeq, 10)
		msg.Metadata["dead_letter_deliveries"] = strconv.FormatUint(d.Deliveries, 10)
		return pub.Publish(topic, msg)
	}
}
