package benchkit

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
)

// Defaults of the Kafka setups, from measurements on kfake (docs/architecture/measurements.md,
// "The batch path"): the cost a message in the Go process falls with
// fewer partitions (fewer produce batches, fetches and broker requests a message),
// and MaxInFlightPerPartition keeps batches full from few partitions.
const (
	// DefaultKafkaPartitions is the partitions of the topic a Kafka setup makes.
	DefaultKafkaPartitions = 4
	// DefaultKafkaInFlight is the subscriber's MaxInFlightPerPartition: records of
	// one partition handed out before the earlier ones are acked, so that batches
	// fill from few partitions.
	DefaultKafkaInFlight = 256
	// DefaultKafkaMaxBatch is the batch handler's batch size in the Kafka setups.
	DefaultKafkaMaxBatch = 512
	// DefaultKafkaProducers is the goroutines publishing at once, each
	// DefaultKafkaChunk records a Publish call.
	DefaultKafkaProducers = 2
	DefaultKafkaChunk     = 512
)

// kafkaDefaults sets the unset Kafka options to their defaults.
func (o *Options) kafkaDefaults() {
	o.KafkaPartitions = cmp.Or(o.KafkaPartitions, DefaultKafkaPartitions)
	o.KafkaInFlight = cmp.Or(o.KafkaInFlight, DefaultKafkaInFlight)
	o.KafkaProducers = cmp.Or(o.KafkaProducers, DefaultKafkaProducers)
	o.KafkaChunk = cmp.Or(o.KafkaChunk, DefaultKafkaChunk)
	o.KafkaMaxBatch = cmp.Or(o.KafkaMaxBatch, DefaultKafkaMaxBatch)
	o.KafkaWindow = cmp.Or(o.KafkaWindow, o.KafkaPartitions*o.KafkaInFlight)
	// The records of the chunk being filled count in the window: it must hold
	// more than one chunk, or the producer would wait for itself.
	o.KafkaWindow = max(o.KafkaWindow, 2*o.KafkaChunk)
}

// TopicPrefix begins the name of every topic and consumer group a Kafka setup
// makes: TopicPrefix, a random run id, then the setup. A Kafka setup deletes the
// topic and the group it made, and nothing else.
const TopicPrefix = "idem-bench-"

// producedAt is the metadata field with the record's produce time (Unix
// nanoseconds), for the latency from produce to commit.
const producedAt = "idem_bench_produced_at"

// runKafka drives the workload through a Kafka topic: producers publish records
// keyed by message UUID (so a record and its retry land in the same partition)
// with adapters/kafka's Publisher, and a Watermill router reads them with
// adapters/kafka's Subscriber (one group member, MaxInFlightPerPartition
// records of a partition at once) into the Batch setup's batch handler behind
// idem's middleware. The clock runs from the first produce until the group's
// committed offsets cover every record; a record's latency is from its Publish
// call to its ack (its batch committed).
func runKafka(ctx context.Context, setup Setup, o Options) (res Result, err error) {
	var brokers []string
	res.Setup = setup
	switch setup {
	case Kafka:
		cluster, err := kfake.NewCluster(kfake.NumBrokers(1),
			kfake.BrokerConfigs(map[string]string{"group.min.session.timeout.ms": "100"}))
		if err != nil {
			return Result{}, fmt.Errorf("start kfake: %w", err)
		}
		defer cluster.Close()
		brokers = cluster.ListenAddrs()
		res.Broker = "kfake (in process) at " + strings.Join(brokers, ",")
	case KafkaExternal:
		if len(o.KafkaBrokers) == 0 {
			return Result{}, errors.New("benchkit: the kafka-external setup needs brokers (idem bench --kafka-brokers, or KAFKA_BROKERS)")
		}
		brokers = o.KafkaBrokers
		res.Broker = "Kafka at " + strings.Join(brokers, ",")
	}
	id := make([]byte, 6)
	_, _ = rand.Read(id)
	topic := TopicPrefix + hex.EncodeToString(id) + "-" + string(setup)
	res.Topic = topic
	client := &kafkago.Client{Addr: kafkago.TCP(brokers...), Timeout: 30 * time.Second}

	if err := createTopic(ctx, client, topic, o.KafkaPartitions); err != nil {
		return Result{}, fmt.Errorf("%s: %w", res.Broker, err)
	}
	// Delete what this run made, and only that: the topic it created (a name
	// that was free, with a random part) and its group.
	defer func() {
		if cerr := cleanupKafka(context.WithoutCancel(ctx), client, topic); cerr != nil {
			cerr = fmt.Errorf("%s: could not delete topic or group %s: %w", res.Broker, topic, cerr)
			if err == nil {
				err = cerr
			}
		}
	}()

	o.Concurrency = o.KafkaPartitions
	o.BatchMaxBatch = o.KafkaMaxBatch
	o.batchConns()
	counter, handler, closeFn, err := open(ctx, Batch, &o)
	if err != nil {
		return Result{}, err
	}
	defer closeFn()
	pool := o.pool

	subCfg := kafka.SubscriberConfig{
		MaxInFlightPerPartition: o.KafkaInFlight,
		MaxConcurrentPartitions: o.KafkaPartitions,
	}
	subCfg.Brokers = brokers
	subCfg.GroupID = topic
	subCfg.MinBytes, subCfg.MaxWait = o.KafkaMinBytes, o.KafkaFetchWait
	sub, err := kafka.NewSubscriber(subCfg)
	if err != nil {
		return Result{}, err
	}
	defer func() { _ = sub.Close() }() // the run is measured by then
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{
		// A JVM broker sharing two loaded cores may answer slowly.
		WriterConfig: kafkago.WriterConfig{Brokers: brokers, ReadTimeout: 30 * time.Second, WriteTimeout: 30 * time.Second},
		PartitionKey: func(_ string, m *message.Message) ([]byte, error) { return []byte(m.UUID), nil },
	})
	if err != nil {
		return Result{}, err
	}
	defer func() { _ = pub.Close() }()

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		return Result{}, err
	}
	hist := newHistogram()
	var handled atomic.Int64
	// window bounds the records produced and not yet handled, so that latency is
	// the pipeline's and not a backlog's age.
	window := make(chan struct{}, o.KafkaWindow)
	measure := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil {
				if ns, perr := strconv.ParseInt(msg.Metadata.Get(producedAt), 10, 64); perr == nil {
					hist.observe(time.Since(time.Unix(0, ns)))
				}
				handled.Add(1)
				select {
				case <-window:
				default:
				}
			}
			return out, err
		}
	}
	router.AddConsumerHandler("bench-kafka", topic, sub, handler).AddMiddleware(measure)
	runCtx, cancel := context.WithCancel(ctx)
	var routerErr error
	routerExited := make(chan struct{})
	go func() { routerErr = router.Run(runCtx); close(routerExited) }()
	stopRouter := func() {
		cancel()
		<-routerExited
	}
	defer stopRouter()
	select {
	case <-router.Running(): // subscribed: the member has joined its group
	case <-routerExited:
		return Result{}, fmt.Errorf("router: %v", routerErr)
	}

	commitsBefore, tripsBefore := counter.n.Load(), counter.trips.Load()
	rng := mrand.New(mrand.NewPCG(o.Seed, 43))
	payload := make([]byte, o.PayloadSize)
	_, _ = rand.Read(payload)
	chunks := make(chan []*message.Message, o.KafkaProducers)
	var pubErr atomic.Pointer[error]
	var pubs sync.WaitGroup
	for range o.KafkaProducers {
		pubs.Go(func() {
			for chunk := range chunks {
				now := strconv.FormatInt(time.Now().UnixNano(), 10)
				for _, m := range chunk {
					m.Metadata.Set(producedAt, now)
				}
				if err := pub.Publish(topic, chunk...); err != nil {
					pubErr.CompareAndSwap(nil, &err)
				}
			}
		})
	}
	total := 0
	expected := int(float64(o.N) * (1 + o.DupRate))
	var peak uint64
	var ms runtime.MemStats
	step := max(o.N/100, 1)
	chunk := make([]*message.Message, 0, o.KafkaChunk)
	m, err := startMeter(ctx, o, setup, pool)
	if err != nil {
		return Result{}, err
	}
	defer m.close()
	start := time.Now()
	add := func(m *message.Message) bool {
		select {
		case window <- struct{}{}:
		case <-routerExited:
			return false
		}
		chunk = append(chunk, m)
		total++
		if len(chunk) == cap(chunk) {
			chunks <- chunk
			chunk = make([]*message.Message, 0, o.KafkaChunk)
		}
		return true
	}
	produced := true
	for i := 0; i < o.N && produced && pubErr.Load() == nil; i++ {
		id := consumer.NewUUID()
		produced = add(message.NewMessage(id, payload))
		// A producer retry: the same message again, with the same key, so in the
		// same partition, a little later.
		if produced && rng.Float64() < o.DupRate {
			produced = add(message.NewMessage(id, payload))
		}
		if i%step == 0 {
			if o.Progress != nil {
				o.Progress(int(handled.Load()), max(expected, total))
			}
			runtime.ReadMemStats(&ms)
			peak = max(peak, ms.HeapInuse)
		}
	}
	if len(chunk) > 0 {
		chunks <- chunk
	}
	close(chunks)
	pubs.Wait()
	if p := pubErr.Load(); p != nil {
		return Result{}, fmt.Errorf("publish to %s: %w", res.Broker, *p)
	}
	if !produced {
		return Result{}, fmt.Errorf("router stopped: %v", routerErr)
	}
	for handled.Load() < int64(total) {
		select {
		case <-routerExited:
			return Result{}, fmt.Errorf("router stopped after %d of %d deliveries: %v", handled.Load(), total, routerErr)
		case <-time.After(time.Millisecond):
		}
		if o.Progress != nil {
			o.Progress(int(handled.Load()), total)
		}
	}
	// Handled is not done: the run ends when the group has committed every offset.
	if err := waitCommitted(ctx, client, topic, o.KafkaPartitions); err != nil {
		return Result{}, fmt.Errorf("%s: %w", res.Broker, err)
	}
	elapsed := time.Since(start)
	if res.CPU, err = m.stop(ctx, total); err != nil {
		return Result{}, err
	}
	if o.Progress != nil {
		o.Progress(total, total)
	}
	runtime.ReadMemStats(&ms)
	peak = max(peak, ms.HeapInuse)
	stopRouter()

	res.Messages, res.Deliveries, res.Elapsed = o.N, total, elapsed
	res.MsgsPerSec = float64(total) / elapsed.Seconds()
	res.P50, res.P99, res.PeakHeapBytes = hist.quantile(0.5), hist.quantile(0.99), peak
	res.CommitsPerMsg = float64(counter.n.Load()-commitsBefore) / float64(total)
	res.TripsPerMsg = float64(counter.trips.Load()-tripsBefore) / float64(total)
	if err := countBusiness(ctx, pool, o, &res); err != nil {
		return Result{}, err
	}
	return res, nil
}

// createTopic makes topic, and fails if it exists: a Kafka setup never writes to
// a topic it did not make. A request that fails in transport (a broker that
// closed an idle connection: broken pipe, reset, EOF) is sent again, twice at
// most; if the lost request had made the topic, the retry finds it existing, and
// since the name carries the run's random id, that topic is this run's own.
func createTopic(ctx context.Context, client *kafkago.Client, topic string, partitions int) error {
	for attempt := 0; ; attempt++ {
		r, err := client.CreateTopics(ctx, &kafkago.CreateTopicsRequest{Topics: []kafkago.TopicConfig{{
			Topic: topic, NumPartitions: partitions, ReplicationFactor: -1,
		}}})
		if err != nil {
			if attempt < 2 && transient(err) {
				continue
			}
			return fmt.Errorf("create topic %s: %w", topic, err)
		}
		err = r.Errors[topic]
		if err != nil && attempt > 0 && errors.Is(err, kafkago.TopicAlreadyExists) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("create topic %s: %w", topic, err)
		}
		return nil
	}
}

// transient reports whether err is a connection lost in transport, which a
// request can be sent again after.
func transient(err error) bool {
	return errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)
}

// cleanupKafka deletes the run's consumer group and topic (they share a name).
func cleanupKafka(ctx context.Context, client *kafkago.Client, topic string) error {
	var errs []error
	g, err := client.DeleteGroups(ctx, &kafkago.DeleteGroupsRequest{GroupIDs: []string{topic}})
	if err != nil {
		errs = append(errs, fmt.Errorf("delete group: %w", err))
	} else if err := g.Errors[topic]; err != nil && !errors.Is(err, kafkago.GroupIdNotFound) {
		errs = append(errs, fmt.Errorf("delete group: %w", err))
	}
	t, err := client.DeleteTopics(ctx, &kafkago.DeleteTopicsRequest{Topics: []string{topic}})
	if err != nil {
		errs = append(errs, fmt.Errorf("delete topic: %w", err))
	} else if err := t.Errors[topic]; err != nil && !errors.Is(err, kafkago.UnknownTopicOrPartition) {
		errs = append(errs, fmt.Errorf("delete topic: %w", err))
	}
	return errors.Join(errs...)
}

// waitCommitted waits, for at most a minute, until the group named topic has
// committed, on every one of the topic's partitions, the partition's end
// offset: until kafka.Lag reads the topic's partitions all at lag 0. An error
// of Lag (a broker that has just started can answer a partition of a new topic
// with a transient error) is read again until the minute is up.
func waitCommitted(ctx context.Context, client *kafkago.Client, topic string, partitions int) error {
	deadline := time.Now().Add(time.Minute)
	for {
		lag, err := kafka.Lag(ctx, client, topic, topic)
		if err == nil && lag.Total == 0 && len(lag.Partitions) == partitions {
			return nil
		}
		if time.Now().After(deadline) {
			if err == nil {
				err = fmt.Errorf("it is %d records behind (%d of %d partitions read)", lag.Total, len(lag.Partitions), partitions)
			}
			return fmt.Errorf("group %s has not committed every offset of %s within a minute of the last ack: %w", topic, topic, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
}
