package kafka_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	kafkago "github.com/segmentio/kafka-go"
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
	cfg.GroupID = "docs-kafka-use" // omit to read partitions without a group (tools, tests)
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

// Read how far a consumer group is behind on a topic, in all and per
// partition: here group docs-kafka-lag, which has committed nothing yet on a topic
// of three records, so it counts from the partition's first offset.
func ExampleLag() {
	brokers, topic, cleanup := exampleTopic("invoices", 3)
	defer cleanup()

	// The client's Transport is where TLS and SASL go: &kafkago.Transport{TLS: …, SASL: …}.
	transport := &kafkago.Transport{}
	defer transport.CloseIdleConnections()
	client := &kafkago.Client{Addr: kafkago.TCP(brokers...), Transport: transport}

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	lag, err := kafka.Lag(ctx, client, "docs-kafka-lag", topic)
	if err != nil {
		panic(err)
	}
	fmt.Println("docs-kafka-lag is", lag.Total, "records behind")
	for _, p := range lag.Partitions {
		fmt.Printf("partition %d: offsets %d to %d, committed %d, lag %d\n",
			p.Partition, p.FirstOffset, p.EndOffset, p.CommittedOffset, p.Lag)
	}
	// Output:
	// docs-kafka-lag is 3 records behind
	// partition 0: offsets 0 to 3, committed -1, lag 3
}

// exampleTopic is ExampleLag's test plumbing: a topic of one partition that
// holds n records, on exampleBroker's brokers. cleanup deletes it.
func exampleTopic(topic string, n int) (brokers []string, name string, cleanup func()) {
	brokers, name, stop := exampleBroker(topic)
	transport := &kafkago.Transport{}
	client := &kafkago.Client{Addr: kafkago.TCP(brokers...), Transport: transport, Timeout: 30 * time.Second}
	ctx := context.Background()
	created, err := client.CreateTopics(ctx, &kafkago.CreateTopicsRequest{Topics: []kafkago.TopicConfig{{
		Topic: name, NumPartitions: 1, ReplicationFactor: 1,
	}}})
	if err == nil {
		err = created.Errors[name]
	}
	if err != nil {
		panic(err)
	}
	records := make([]kafkago.Record, n)
	for i := range records {
		records[i].Value = kafkago.NewBytes([]byte(strconv.Itoa(i)))
	}
	produced, err := client.Produce(ctx, &kafkago.ProduceRequest{
		Topic: name, RequiredAcks: kafkago.RequireAll, Records: kafkago.NewRecordReader(records...),
	})
	if err == nil {
		err = produced.Error
	}
	if err != nil {
		panic(err)
	}
	return brokers, name, func() {
		transport.CloseIdleConnections()
		stop()
	}
}

// exampleBroker is the example's test plumbing: the brokers in KAFKA_BROKERS
// with a fresh topic name, or else an in-process kfake cluster. cleanup
// deletes that topic from KAFKA_BROKERS, or stops the cluster.
func exampleBroker(topic string) (brokers []string, name string, cleanup func()) {
	if v := os.Getenv("KAFKA_BROKERS"); v != "" {
		brokers, name = strings.Split(v, ","), fmt.Sprintf("%s-%d", topic, time.Now().UnixNano())
		return brokers, name, func() {
			transport := &kafkago.Transport{}
			defer transport.CloseIdleConnections()
			client := &kafkago.Client{Addr: kafkago.TCP(brokers...), Transport: transport, Timeout: 30 * time.Second}
			_, _ = client.DeleteTopics(context.Background(), &kafkago.DeleteTopicsRequest{Topics: []string{name}})
		}
	}
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		panic(err)
	}
	return cluster.ListenAddrs(), topic, cluster.Close
}
