package effectsdb

import (
	"encoding/json"
	"fmt"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"
)

// PublishKindPrefix starts the kind of an effect that publishes a Watermill message:
// "publish:<topic>".
const PublishKindPrefix = "publish:"

// PublishKind is the effect kind that publishes to topic.
func PublishKind(topic string) string { return PublishKindPrefix + topic }

// TopicOf returns the topic of a publish kind, and false for other kinds.
func TopicOf(kind string) (string, bool) {
	return strings.CutPrefix(kind, PublishKindPrefix)
}

// storedMessage is how a Watermill message is kept in an effect's payload.
type storedMessage struct {
	UUID     string            `json:"uuid"`
	Metadata map[string]string `json:"metadata,omitempty"`
	Payload  []byte            `json:"payload"`
}

// EncodeMessage stores a Watermill message (UUID, metadata and payload) as an effect
// payload.
func EncodeMessage(msg *message.Message) ([]byte, error) {
	return json.Marshal(storedMessage{UUID: msg.UUID, Metadata: msg.Metadata, Payload: msg.Payload})
}

// DecodeMessage is the inverse of EncodeMessage. The message keeps its UUID, so the
// broker and the next consumer's inbox see one ID on every attempt.
func DecodeMessage(b []byte) (*message.Message, error) {
	var s storedMessage
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("decode stored message: %w", err)
	}
	msg := message.NewMessage(s.UUID, s.Payload)
	for k, v := range s.Metadata {
		msg.Metadata.Set(k, v)
	}
	return msg, nil
}

// PublishEffect makes the effect that publishes msg to topic. Its key is the
// message's UUID, so a message is enqueued once however often the handler runs.
func PublishEffect(topic string, msg *message.Message) (Effect, error) {
	payload, err := EncodeMessage(msg)
	if err != nil {
		return Effect{}, err
	}
	return Effect{Kind: PublishKind(topic), Key: msg.UUID, Payload: payload}, nil
}
