package effects_test

import "github.com/ThreeDotsLabs/watermill/message"

func newMsg() *message.Message {
	m := message.NewMessage("0192f0c4-0000-7000-8000-000000000001", []byte("body"))
	m.Metadata.Set("k", "v")
	return m
}
