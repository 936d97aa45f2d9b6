package payments

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats-server/v2/server"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/adapters/nats"
)

// Broker names.
const (
	NATS  = "nats"
	Kafka = "kafka"
)

// Partitions is the payments topic's partition count on Kafka: enough for three
// consumer processes to share.
const Partitions = 6

// StartNATS starts an embedded JetStream server on 127.0.0.1:port (-1: any free
// port) storing under dir, and returns it; ClientURL says where it is.
func StartNATS(dir string, port int) (*server.Server, error) {
	s, err := server.NewServer(&server.Options{
		Host: "127.0.0.1", Port: port, JetStream: true, StoreDir: dir, NoLog: true, NoSigs: true,
	})
	if err != nil {
		return nil, err
	}
	go s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		s.Shutdown()
		return nil, errors.New("embedded nats-server did not start within 10s")
	}
	return s, nil
}

// StartKafka starts an in-process Kafka-protocol broker (franz-go's kfake) and
// returns it; ListenAddrs says where it is. Its group.min.session.timeout.ms is
// set as a broker config, not only with kfake.GroupMinSessionTimeout: kfake
// enforces that option but reports its static default (6 s) to DescribeConfigs,
// which would make Connect ask for 6 s sessions.
func StartKafka() (*kfake.Cluster, error) {
	return kfake.NewCluster(kfake.NumBrokers(1),
		kfake.BrokerConfigs(map[string]string{"group.min.session.timeout.ms": "100"}),
		kfake.SeedTopics(Partitions, Topic))
}

// Endpoint is a broker a process connects to: Broker is NATS or Kafka, Addr a NATS
// URL or comma-separated Kafka brokers, Group the consumer group or durable, and
// Topic the topic or subject (Topic when empty).
type Endpoint struct {
	Broker, Addr, Group, Topic string
}

// TopicName is e.Topic, or Topic when that is empty.
func (e Endpoint) TopicName() string {
	if e.Topic == "" {
		return Topic
	}
	return e.Topic
}

// String is "broker|addr|group|topic", for an environment variable.
func (e Endpoint) String() string {
	return e.Broker + "|" + e.Addr + "|" + e.Group + "|" + e.Topic
}

// ParseEndpoint reverses String.
func ParseEndpoint(s string) (Endpoint, error) {
	p := strings.Split(s, "|")
	if len(p) != 4 {
		return Endpoint{}, fmt.Errorf("endpoint %q: want broker|addr|group|topic", s)
	}
	return Endpoint{p[0], p[1], p[2], p[3]}, nil
}

// CreateTopic makes topic on a Kafka endpoint with Partitions partitions (one
// replica), unless it exists, so that a producer can publish before any consumer
// has joined, whatever the broker's num.partitions. A NATS stream is made by
// its publisher, so it does nothing there.
func CreateTopic(ctx context.Context, e Endpoint, topic string) error {
	if e.Broker != Kafka {
		return nil
	}
	client := &kafkago.Client{Addr: kafkago.TCP(strings.Split(e.Addr, ",")...), Timeout: 30 * time.Second}
	res, err := client.CreateTopics(ctx, &kafkago.CreateTopicsRequest{Topics: []kafkago.TopicConfig{{
		Topic: topic, NumPartitions: Partitions, ReplicationFactor: 1,
	}}})
	if err != nil {
		return fmt.Errorf("create topic %s on %s: %w", topic, e.Addr, err)
	}
	if err := res.Errors[topic]; err != nil && !errors.Is(err, kafkago.TopicAlreadyExists) {
		return fmt.Errorf("create topic %s on %s: %w", topic, e.Addr, err)
	}
	return nil
}

// DeleteTopic deletes a run's topic from a Kafka endpoint, or the stream that holds
// it (with its consumers) from a NATS endpoint, so that runs against a shared
// broker leave nothing behind.
func DeleteTopic(ctx context.Context, e Endpoint, topic string) error {
	if e.Broker == NATS {
		nc, err := natsgo.Connect(e.Addr)
		if err != nil {
			return err
		}
		defer nc.Close()
		js, err := jetstream.New(nc)
		if err != nil {
			return err
		}
		if err := js.DeleteStream(ctx, nats.Topology{}.StreamOf(topic)); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
			return err
		}
		return nil
	}
	if e.Broker != Kafka {
		return nil
	}
	client := &kafkago.Client{Addr: kafkago.TCP(strings.Split(e.Addr, ",")...), Timeout: 30 * time.Second}
	res, err := client.DeleteTopics(ctx, &kafkago.DeleteTopicsRequest{Topics: []string{topic}})
	if err != nil {
		return err
	}
	if err := res.Errors[topic]; err != nil && !errors.Is(err, kafkago.UnknownTopicOrPartition) {
		return err
	}
	return nil
}

// Conn is the publisher and subscriber of one process on an Endpoint.
type Conn struct {
	Publisher  message.Publisher
	Subscriber message.Subscriber
	close      func()
	producer   *natsProducer
}

// PastWindow is how many messages the NATS Publisher sent without Nats-Msg-Id
// (every other retry of a message it had published: see Connect); 0 on Kafka,
// which keeps every copy a producer sends.
func (c *Conn) PastWindow() int64 {
	if c.producer == nil {
		return 0
	}
	return c.producer.pastWindow.Load()
}

// Close closes the subscriber, publisher and connection.
func (c *Conn) Close() {
	_ = c.Subscriber.Close()
	_ = c.Publisher.Close()
	if c.close != nil {
		c.close()
	}
}

// Tuning of the consumers for a chaos run: a killed member's messages must come
// back in seconds, not the production defaults' tens of seconds. Each SIGKILLed
// Kafka member holds its partitions until the coordinator has missed its
// heartbeats for a whole session, then the group rebalances, so the session is
// the floor a real broker accepts from scripts/services and docker-compose
// (group.min.session.timeout.ms=1000; a stock broker's is 6 s and refuses it).
// Measured on the real broker at N = 20,000 with the same seed: 1.5 s / 200 ms
// took 3m50s, 1 s / 100 ms 2m40s.
const (
	kafkaHeartbeat   = 100 * time.Millisecond
	kafkaSession     = 1000 * time.Millisecond
	kafkaRebalance   = 2 * time.Second
	nackBackoffChaos = 20 * time.Millisecond
)

// Feeding batches: how many messages a ConnectBatched subscriber holds in flight.
// On Kafka, records of one partition in flight at once (MaxInFlightPerPartition);
// on NATS, messages held per subscriber (Concurrency) and the free slots a pull
// waits for (FetchBatch).
const (
	batchedInFlight    = 16
	batchedConcurrency = 64
	batchedFetch       = 16
)

// Connect opens a publisher and a subscriber on e. The subscriber delivers one
// record of a Kafka partition at a time, and pulls from NATS as soon as a slot is
// free. On NATS the publisher sends every other retry of a message (a UUID it has
// published before) without Nats-Msg-Id, past the stream's duplicate window, so
// that half of a producer's duplicates reach the consumers as they do on Kafka;
// Conn.PastWindow counts them.
func Connect(e Endpoint, logger watermill.LoggerAdapter) (*Conn, error) {
	return connect(e, logger, false)
}

// ConnectBatched is Connect with a subscriber that feeds batches (a group commit or
// a batch handler downstream): on Kafka it holds several records of a partition in
// flight (MaxInFlightPerPartition above 1: records of one key stay in order, and
// only the contiguous acked prefix is committed); on NATS it holds more messages
// and pulls them in batches (Concurrency and FetchBatch). Its Kafka publisher keys
// each record by the payment's ID (the message UUID): records without a key keep
// partition order among themselves, one in flight at a time.
func ConnectBatched(e Endpoint, logger watermill.LoggerAdapter) (*Conn, error) {
	return connect(e, logger, true)
}

func connect(e Endpoint, logger watermill.LoggerAdapter, batched bool) (*Conn, error) {
	switch e.Broker {
	case NATS:
		nc, err := natsgo.Connect(e.Addr, natsgo.MaxReconnects(-1), natsgo.ReconnectWait(50*time.Millisecond))
		if err != nil {
			return nil, fmt.Errorf("connect to nats-server at %s: %w", e.Addr, err)
		}
		topo := nats.Topology{AutoProvision: true, Stream: jetstream.StreamConfig{Storage: jetstream.FileStorage}}
		pub, err := nats.NewPublisher(nc, nats.PublisherConfig{Topology: topo, Logger: logger})
		if err != nil {
			nc.Close()
			return nil, err
		}
		producer, err := newNATSProducer(nc, pub)
		if err != nil {
			_ = pub.Close()
			nc.Close()
			return nil, err
		}
		scfg := nats.SubscriberConfig{
			Topology: topo, Durable: e.Group, Concurrency: 8,
			// A killed member's messages come back after AckWait.
			Consumer: jetstream.ConsumerConfig{AckWait: 2 * time.Second, MaxDeliver: -1},
			// nackBackoffChaos, doubling with each delivery up to a second.
			NakDelay: func(n uint64) time.Duration { return min(nackBackoffChaos<<min(n-1, 6), time.Second) },
			Logger:   logger,
		}
		if batched {
			scfg.Concurrency, scfg.FetchBatch = batchedConcurrency, batchedFetch
		}
		sub, err := nats.NewSubscriber(nc, scfg)
		if err != nil {
			_ = pub.Close()
			nc.Close()
			return nil, err
		}
		return &Conn{Publisher: producer, Subscriber: sub, close: nc.Close, producer: producer}, nil
	case Kafka:
		brokers := strings.Split(e.Addr, ",")
		pcfg := kafka.PublisherConfig{WriterConfig: kafkago.WriterConfig{Brokers: brokers}, Logger: logger}
		if batched {
			pcfg.PartitionKey = func(_ string, msg *message.Message) ([]byte, error) { return []byte(msg.UUID), nil }
		}
		pub, err := kafka.NewPublisher(pcfg)
		if err != nil {
			return nil, err
		}
		cfg := kafka.SubscriberConfig{TopicPartitions: Partitions, TopicReplicationFactor: 1, NackBackoff: nackBackoffChaos, Logger: logger}
		cfg.Brokers = brokers
		cfg.GroupID = e.Group
		cfg.SessionTimeout, cfg.HeartbeatInterval = sessionFor(brokers, e.TopicName())
		cfg.RebalanceTimeout = kafkaRebalance
		if batched {
			cfg.MaxInFlightPerPartition = batchedInFlight
		}
		sub, err := kafka.NewSubscriber(cfg)
		if err != nil {
			_ = pub.Close()
			return nil, err
		}
		return &Conn{Publisher: pub, Subscriber: sub}, nil
	}
	return nil, fmt.Errorf("unknown broker %q (want nats or kafka)", e.Broker)
}

// sessionFor is the session timeout and heartbeat interval of a chaos run's
// consumers on brokers: kafkaSession, or the broker's own floor
// (group.min.session.timeout.ms) when that is longer. A stock broker's floor is
// 6 s and it refuses a member that asks for less (INVALID_SESSION_TIMEOUT), which
// would leave the demo waiting for a group that never forms. If the broker cannot
// say, kafkaSession is tried.
func sessionFor(brokers []string, topic string) (session, heartbeat time.Duration) {
	session = kafkaSession
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if floor, err := SessionFloor(ctx, brokers, topic); err == nil && floor > session {
		session = floor
	}
	return session, max(kafkaHeartbeat, session/10)
}

// SessionFloor asks a Kafka broker for group.min.session.timeout.ms, the
// shortest session timeout it lets a group member ask for. topic narrows the
// metadata request that finds a broker to ask.
func SessionFloor(ctx context.Context, brokers []string, topic string) (time.Duration, error) {
	client := &kafkago.Client{Addr: kafkago.TCP(brokers...), Timeout: 10 * time.Second}
	meta, err := client.Metadata(ctx, &kafkago.MetadataRequest{Topics: []string{topic}})
	if err != nil {
		return 0, err
	}
	if len(meta.Brokers) == 0 {
		return 0, errors.New("metadata names no broker")
	}
	const name = "group.min.session.timeout.ms"
	res, err := client.DescribeConfigs(ctx, &kafkago.DescribeConfigsRequest{Resources: []kafkago.DescribeConfigRequestResource{{
		ResourceType: kafkago.ResourceTypeBroker, ResourceName: strconv.Itoa(meta.Brokers[0].ID), ConfigNames: []string{name},
	}}})
	if err != nil {
		return 0, err
	}
	for _, r := range res.Resources {
		if r.Error != nil {
			return 0, r.Error
		}
		for _, c := range r.ConfigEntries {
			if c.ConfigName == name {
				ms, err := strconv.Atoi(c.ConfigValue)
				if err != nil {
					return 0, fmt.Errorf("%s = %q: %w", name, c.ConfigValue, err)
				}
				return time.Duration(ms) * time.Millisecond, nil
			}
		}
	}
	return 0, fmt.Errorf("the broker did not return %s", name)
}

// Backlog is how many messages of the topic e's group or durable has not yet
// consumed for good: on Kafka, the group's lag (kafka.Lag's Total); on
// JetStream, the durable's pending plus delivered-but-unacked messages. Zero
// means the broker will deliver nothing more.
func Backlog(ctx context.Context, e Endpoint, topic string) (int64, error) {
	switch e.Broker {
	case NATS:
		nc, err := natsgo.Connect(e.Addr)
		if err != nil {
			return 0, err
		}
		defer nc.Close()
		js, err := jetstream.New(nc)
		if err != nil {
			return 0, err
		}
		c, err := js.Consumer(ctx, nats.Topology{}.StreamOf(topic), e.Group)
		if err != nil {
			return 0, err
		}
		info, err := c.Info(ctx)
		if err != nil {
			return 0, err
		}
		return int64(info.NumPending) + int64(info.NumAckPending), nil
	case Kafka:
		client := &kafkago.Client{Addr: kafkago.TCP(strings.Split(e.Addr, ",")...), Timeout: 5 * time.Second}
		lag, err := kafka.Lag(ctx, client, e.Group, topic)
		return lag.Total, err
	}
	return 0, fmt.Errorf("unknown broker %q", e.Broker)
}
