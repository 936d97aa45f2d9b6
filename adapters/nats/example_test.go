package nats_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats-server/v2/server"
	natsgo "github.com/nats-io/nats.go"

	idemnats "github.com/idemkit/idem/adapters/nats"
)

// A handler fails once, and the message comes back after the nak delay with
// its delivery count; then a permanent failure ends it with Term.
func Example() {
	dir, _ := os.MkdirTemp("", "idem-nats-example")
	defer func() { _ = os.RemoveAll(dir) }()
	srv, _ := server.NewServer(&server.Options{Port: -1, JetStream: true, StoreDir: dir, NoLog: true, NoSigs: true})
	go srv.Start()
	srv.ReadyForConnections(10 * time.Second)
	defer srv.WaitForShutdown()
	defer srv.Shutdown()

	nc, err := natsgo.Connect(srv.ClientURL())
	if err != nil {
		fmt.Println(err)
		return
	}
	defer nc.Close()

	topo := idemnats.Topology{AutoProvision: true}
	pub, _ := idemnats.NewPublisher(nc, idemnats.PublisherConfig{Topology: topo})
	defer func() { _ = pub.Close() }()
	sub, _ := idemnats.NewSubscriber(nc, idemnats.SubscriberConfig{
		Topology: topo,
		Durable:  "billing",
		NakDelay: func(uint64) time.Duration { return 100 * time.Millisecond },
	})
	defer func() { _ = sub.Close() }()

	msgs, _ := sub.Subscribe(context.Background(), "orders")
	_ = pub.Publish("orders", message.NewMessage("order-1", []byte(`{"total":42}`)))

	handle := func(msg *message.Message) error {
		fmt.Println(msg.UUID, "delivery", msg.Metadata.Get(idemnats.MetadataNumDelivered),
			"seq", msg.Metadata.Get(idemnats.MetadataStreamSeq))
		if msg.Metadata.Get(idemnats.MetadataNumDelivered) == "1" {
			return errors.New("database busy") // transient: nak with delay
		}
		idemnats.Term(msg) // permanent: never deliver again
		return errors.New("card declined")
	}
	for range 2 {
		msg := <-msgs
		if err := handle(msg); err != nil {
			msg.Nack()
		} else {
			msg.Ack()
		}
	}
	time.Sleep(100 * time.Millisecond)
	st := sub.Stats()
	fmt.Println("acked", st.Acked, "nacked", st.Nacked, "terminated", st.Terminated)

	// Output:
	// order-1 delivery 1 seq 1
	// order-1 delivery 2 seq 1
	// acked 0 nacked 1 terminated 1
}
