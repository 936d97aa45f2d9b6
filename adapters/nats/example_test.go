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
	"github.com/nats-io/nats.go/jetstream"

	idemnats "github.com/idemkit/idem/adapters/nats"
)

// A handler fails once, and the message comes back after the nak delay with
// its delivery count; then a permanent failure ends it with Term.
func Example() {
	nc, topic, cleanup := exampleServer("orders")
	defer cleanup()

	// The connection is yours: Close on the adapters leaves it open.
	topo := idemnats.Topology{AutoProvision: true} // one stream per topic, subject = topic
	pub, err := idemnats.NewPublisher(nc, idemnats.PublisherConfig{Topology: topo})
	if err != nil {
		panic(err)
	}
	defer func() { _ = pub.Close() }()
	sub, err := idemnats.NewSubscriber(nc, idemnats.SubscriberConfig{
		Topology:     topo,
		Durable:      "docs-nats-use-" + topic, // the consumer group; required
		Concurrency:  16,                       // messages held at once; MaxAckPending follows
		Consumer:     jetstream.ConsumerConfig{AckWait: 30 * time.Second, MaxDeliver: 20},
		OnMaxDeliver: idemnats.PublishDeadLetter(pub, topic+".dead"),
		NakDelay:     func(uint64) time.Duration { return 100 * time.Millisecond },
	})
	if err != nil {
		panic(err)
	}
	defer func() { _ = sub.Close() }()

	msgs, err := sub.Subscribe(context.Background(), topic)
	if err != nil {
		panic(err)
	}
	if err := pub.Publish(topic, message.NewMessage("order-1", []byte(`{"total":42}`))); err != nil {
		panic(err)
	}

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
	st := sub.Stats()
	for deadline := time.Now().Add(10 * time.Second); st.Terminated == 0 && time.Now().Before(deadline); st = sub.Stats() {
		time.Sleep(10 * time.Millisecond) // the Term is sent after Nack returns
	}
	fmt.Println("acked", st.Acked, "nacked", st.Nacked, "terminated", st.Terminated)

	// Output:
	// order-1 delivery 1 seq 1
	// order-1 delivery 2 seq 1
	// acked 0 nacked 1 terminated 1
}

// exampleServer is the example's test plumbing: a connection to NATS_URL with a
// fresh topic name, or else to an embedded JetStream server. cleanup closes the
// connection, deletes the topic's stream from NATS_URL, and stops an embedded
// server.
func exampleServer(topic string) (nc *natsgo.Conn, name string, cleanup func()) {
	if url := os.Getenv("NATS_URL"); url != "" {
		nc, err := natsgo.Connect(url)
		if err != nil {
			panic(err)
		}
		name = fmt.Sprintf("%s_%d", topic, time.Now().UnixNano())
		return nc, name, func() {
			if js, err := nc.JetStream(); err == nil {
				_ = js.DeleteStream(idemnats.Topology{}.StreamOf(name))
			}
			nc.Close()
		}
	}
	dir, err := os.MkdirTemp("", "idem-nats-example")
	if err != nil {
		panic(err)
	}
	srv, err := server.NewServer(&server.Options{Port: -1, JetStream: true, StoreDir: dir, NoLog: true, NoSigs: true})
	if err != nil {
		panic(err)
	}
	go srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		panic("embedded nats-server did not start")
	}
	if nc, err = natsgo.Connect(srv.ClientURL()); err != nil {
		panic(err)
	}
	return nc, topic, func() {
		nc.Close()
		srv.Shutdown()
		srv.WaitForShutdown()
		_ = os.RemoveAll(dir)
	}
}
