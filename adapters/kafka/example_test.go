package kafka_test

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/idemkit/idem/adapters/kafka"
)

// Publish a message and consume it in a consumer group, acking it so that
// its offset is committed.
func Example() {
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		panic(err)
	}
	defer cluster.Close()
	brokers := cluster.ListenAddrs()

	cfg := kafka.SubscriberConfig{}
	cfg.Brokers = brokers
	cfg.GroupID = "billing"
	sub, err := kafka.NewSubscriber(cfg)
	if err != nil {
		panic(err)
	}
	defer func() { _ = sub.Close() }()
	if err := sub.SubscribeInitialize("orders"); err != nil {
		panic(err)
	}

	pcfg := kafka.PublisherConfig{PartitionKey: kafka.PartitionKeyFromMetadata("order_id")}
	pcfg.Brokers = brokers
	pub, err := kafka.NewPublisher(pcfg)
	if err != nil {
		panic(err)
	}
	defer func() { _ = pub.Close() }()
	msg := message.NewMessage("0190f1c2-7d1e-7c3a-9d43-1f2a3b4c5d6e", []byte(`{"amount":42}`))
	msg.Metadata.Set("order_id", "ord_1")
	if err := pub.Publish("orders", msg); err != nil {
		panic(err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	msgs, err := sub.Subscribe(ctx, "orders")
	if err != nil {
		panic(err)
	}
	got := <-msgs
	fmt.Println(got.UUID, string(got.Payload))
	fmt.Println(kafka.PartitionOffsetKey(got), got.Metadata.Get(kafka.MetadataKey),
		got.Metadata.Get(kafka.MetadataDeliveryCount))
	got.Ack()
	// Output:
	// 0190f1c2-7d1e-7c3a-9d43-1f2a3b4c5d6e {"amount":42}
	// orders/0/0 ord_1 1
}
