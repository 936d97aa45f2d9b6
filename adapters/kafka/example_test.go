package kafka_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/idemkit/idem/adapters/kafka"
)

// Publish a message and consume it in a consumer group, acking it so that
// its offset is committed.
func Example() {
	brokers, topic, cleanup := exampleBroker("orders")
	defer cleanup()

	cfg := kafka.SubscriberConfig{}
	cfg.Brokers = brokers
	cfg.GroupID = "billing" // omit to read partitions without a group (tools, tests)
	sub, err := kafka.NewSubscriber(cfg)
	if err != nil {
		panic(err)
	}
	defer func() { _ = sub.Close() }()
	if err := sub.SubscribeInitialize(topic); err != nil { // optional: creates the topic if missing
		panic(err)
	}

	pcfg := kafka.PublisherConfig{
		// Records with the same key land on the same partition, in order.
		PartitionKey: kafka.PartitionKeyFromMetadata("order_id"),
	}
	pcfg.Brokers = brokers // kafka-go's WriterConfig, embedded
	pub, err := kafka.NewPublisher(pcfg)
	if err != nil {
		panic(err)
	}
	defer func() { _ = pub.Close() }()
	msg := message.NewMessage("0190f1c2-7d1e-7c3a-9d43-1f2a3b4c5d6e", []byte(`{"amount":42}`))
	msg.Metadata.Set("order_id", "ord_1")
	// Publish returns after the broker acked every record (acks=all); many
	// messages in one call are written as one batch.
	if err := pub.Publish(topic, msg); err != nil {
		panic(err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	msgs, err := sub.Subscribe(ctx, topic)
	if err != nil {
		panic(err)
	}
	got := <-msgs
	fmt.Println(got.UUID, string(got.Payload))
	fmt.Println("partition", got.Metadata.Get(kafka.MetadataPartition), "offset", got.Metadata.Get(kafka.MetadataOffset),
		"key", got.Metadata.Get(kafka.MetadataKey), "delivery", got.Metadata.Get(kafka.MetadataDeliveryCount))
	got.Ack() // commit-able; got.Nack() delivers it again after a pause that grows per record
	// Output:
	// 0190f1c2-7d1e-7c3a-9d43-1f2a3b4c5d6e {"amount":42}
	// partition 0 offset 0 key ord_1 delivery 1
}

// exampleBroker is the example's test plumbing: the brokers in KAFKA_BROKERS
// with a fresh topic name, or else an in-process kfake cluster. cleanup stops
// the cluster.
func exampleBroker(topic string) (brokers []string, name string, cleanup func()) {
	if v := os.Getenv("KAFKA_BROKERS"); v != "" {
		return strings.Split(v, ","), fmt.Sprintf("%s-%d", topic, time.Now().UnixNano()), func() {}
	}
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		panic(err)
	}
	return cluster.ListenAddrs(), topic, cluster.Close
}
