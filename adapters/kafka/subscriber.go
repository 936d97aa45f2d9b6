package kafka

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/segmentio/kafka-go"
)

var (
	_ message.Subscriber           = (*Subscriber)(nil)
	_ message.SubscribeInitializer = (*Subscriber)(nil)
)

// Subscriber delivers Kafka records as Watermill messages. See the package
// documentation for what it guarantees.
type Subscriber struct {
	cfg     SubscriberConfig
	logger  watermill.LoggerAdapter
	metrics *metrics

	mu      sync.Mutex
	closed  bool
	closing chan struct{}
	wg      sync.WaitGroup
}

// NewSubscriber returns a Subscriber. It does not connect until Subscribe.
func NewSubscriber(cfg SubscriberConfig) (*Subscriber, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, fmt.Errorf("kafka: register metrics: %w", err)
	}
	return &Subscriber{
		cfg:     cfg,
		logger:  cfg.Logger,
		metrics: m,
		closing: make(chan struct{}),
	}, nil
}

// Subscribe starts consuming topic. With a GroupID, each call joins the
// group as one member; without, it reads the configured partitions. The
// channel is closed when ctx ends or the Subscriber closes.
//
// With a GroupID, Subscribe returns once this member has joined the group
// for the first time, or the group has refused it for a reason retrying
// cannot fix (a *GroupRefusedError, for example a SessionTimeout outside the
// broker's bounds), or a first attempt failed for a reason that may pass (a
// broker that cannot be reached: the member keeps trying, and logs). A
// refusal after that ends the subscription: it is logged at error level,
// and the channel closes.
//
// Each message must be acked or nacked. With MaxInFlightPerPartition 1 (the
// default) the next message of its partition is delivered only after that;
// with more, see SubscriberConfig.MaxInFlightPerPartition.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	// Look the partitions up before taking the lock, so that a slow broker
	// does not hold up Close.
	var partitions []int
	if s.cfg.GroupID == "" {
		var err error
		if partitions, err = s.partitions(ctx, topic); err != nil {
			return nil, err
		}
	}

	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, ErrSubscriberClosed
	}
	ctx, cancel := context.WithCancel(ctx)
	out := make(chan *message.Message)
	sub := &subscription{
		s:      s,
		topic:  topic,
		out:    out,
		slots:  make(chan struct{}, s.cfg.MaxConcurrentPartitions*s.cfg.MaxInFlightPerPartition),
		logger: s.logger.With(watermill.LogFields{"topic": topic, "group": s.cfg.GroupID}),
		// One transport per Subscribe call: it pools a connection per
		// concurrent fetch, so partitions do not queue behind each other's
		// long polls (a broker answers one request per connection at a time).
		transport: s.transport(topic),

		deliveries: deliveryCounter{m: map[topicPartition]map[int64]int{}},
	}

	// joined learns the outcome of the first join: nil, a refusal, or why
	// the subscription stopped before it.
	joined := make(chan error, 1)
	var run func(context.Context)
	if s.cfg.GroupID != "" {
		group, err := kafka.NewConsumerGroup(s.groupConfig(topic))
		if err != nil {
			s.mu.Unlock()
			cancel()
			return nil, fmt.Errorf("kafka: consumer group: %w", err)
		}
		var once sync.Once
		report := func(err error) { once.Do(func() { joined <- err }) }
		run = func(ctx context.Context) { sub.runGroup(ctx, group, report) }
	} else {
		joined <- nil
		run = func(ctx context.Context) { sub.runPartitions(ctx, partitions) }
	}

	done := make(chan struct{})
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer close(done)
		defer close(out)
		defer sub.transport.CloseIdleConnections()
		defer cancel()
		go func() {
			select {
			case <-s.closing:
				cancel()
			case <-ctx.Done():
			}
		}()
		run(ctx)
	}()
	s.mu.Unlock()

	if err := <-joined; err != nil {
		<-done
		return nil, err
	}
	return out, nil
}

// SubscribeInitialize creates topic with TopicPartitions partitions and
// TopicReplicationFactor replicas, unless it exists already, and returns once the
// brokers' metadata lists it with a leader for every partition (at most 30 s), so
// that a group joined next is assigned its partitions.
func (s *Subscriber) SubscribeInitialize(topic string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	transport := s.transport(topic)
	defer transport.CloseIdleConnections()
	client := &kafka.Client{Addr: kafka.TCP(s.cfg.Brokers...), Transport: transport}
	res, err := client.CreateTopics(ctx, &kafka.CreateTopicsRequest{
		Topics: []kafka.TopicConfig{{
			Topic:             topic,
			NumPartitions:     s.cfg.TopicPartitions,
			ReplicationFactor: s.cfg.TopicReplicationFactor,
		}},
	})
	if err != nil {
		return fmt.Errorf("kafka: create topic %s: %w", topic, err)
	}
	if err := res.Errors[topic]; err != nil && !errors.Is(err, kafka.TopicAlreadyExists) {
		return fmt.Errorf("kafka: create topic %s: %w", topic, err)
	}
	return s.awaitTopic(ctx, topic)
}

// awaitTopic waits until the brokers' metadata lists topic with every partition
// led. A broker answers CreateTopics before its metadata has the new topic; a
// group whose leader assigns partitions in that moment finds no partition of
// the topic, and kafka-go's group (without WatchPartitionChanges) never assigns
// them later: its members would wait for ever.
func (s *Subscriber) awaitTopic(ctx context.Context, topic string) error {
	for {
		// A transport of its own each time: metadata is cached per transport.
		transport := s.transport(topic)
		client := &kafka.Client{Addr: kafka.TCP(s.cfg.Brokers...), Transport: transport}
		md, err := client.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{topic}})
		transport.CloseIdleConnections()
		if err == nil && topicLed(md, topic) {
			return nil
		}
		select {
		case <-ctx.Done():
			if err == nil {
				err = errors.New("its partitions have no leader yet")
			}
			return fmt.Errorf("kafka: topic %s is not ready: %w", topic, err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// topicLed reports whether md lists topic, without error, with partitions that
// all have a leader.
func topicLed(md *kafka.MetadataResponse, topic string) bool {
	for _, t := range md.Topics {
		if t.Name != topic {
			continue
		}
		if t.Error != nil || len(t.Partitions) == 0 {
			return false
		}
		for _, p := range t.Partitions {
			if p.Error != nil || p.Leader.Host == "" {
				return false
			}
		}
		return true
	}
	return false
}

// Close stops every subscription, waits until their goroutines are gone and
// leaves the consumer groups. The records acked before Close are committed;
// those still in handlers are neither acked nor committed: the group delivers
// them again.
func (s *Subscriber) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	close(s.closing)
	s.mu.Unlock()
	s.wg.Wait()
	return nil
}

// transport talks to the brokers as the Dialer would, caching the metadata of
// topic only.
func (s *Subscriber) transport(topic string) *kafka.Transport {
	return dialerTransport(s.cfg.Dialer, DefaultMetadataTTL, []string{topic})
}

// dialerTransport talks to the brokers as d would (its DialFunc, TLS, SASL and
// client ID), caching the metadata of topics only, for metadataTTL. The
// Publisher's and the Subscriber's transports are made here.
func dialerTransport(d *kafka.Dialer, metadataTTL time.Duration, topics []string) *kafka.Transport {
	return &kafka.Transport{
		Dial:           d.DialFunc,
		ClientID:       d.ClientID,
		TLS:            d.TLS,
		SASL:           d.SASLMechanism,
		MetadataTTL:    metadataTTL,
		MetadataTopics: topics,
	}
}

func (s *Subscriber) groupConfig(topic string) kafka.ConsumerGroupConfig {
	c := s.cfg.ReaderConfig
	return kafka.ConsumerGroupConfig{
		ID:                     c.GroupID,
		Brokers:                c.Brokers,
		Dialer:                 c.Dialer,
		Topics:                 []string{topic},
		GroupBalancers:         c.GroupBalancers,
		HeartbeatInterval:      c.HeartbeatInterval,
		PartitionWatchInterval: c.PartitionWatchInterval,
		WatchPartitionChanges:  c.WatchPartitionChanges,
		SessionTimeout:         c.SessionTimeout,
		RebalanceTimeout:       c.RebalanceTimeout,
		JoinGroupBackoff:       c.JoinGroupBackoff,
		RetentionTime:          c.RetentionTime,
		StartOffset:            c.StartOffset,
		Logger:                 c.Logger,
		ErrorLogger:            c.ErrorLogger,
	}
}

// partitions lists the partitions to read without a group.
func (s *Subscriber) partitions(ctx context.Context, topic string) ([]int, error) {
	var err error
	for _, broker := range s.cfg.Brokers {
		var ps []kafka.Partition
		ps, err = s.cfg.Dialer.LookupPartitions(ctx, "tcp", broker, topic)
		if err != nil {
			continue
		}
		var ids []int
		for _, p := range ps {
			if len(s.cfg.Partitions) == 0 || slices.Contains(s.cfg.Partitions, p.ID) {
				ids = append(ids, p.ID)
			}
		}
		if len(ids) == 0 {
			return nil, fmt.Errorf("kafka: topic %s has none of partitions %v", topic, s.cfg.Partitions)
		}
		return ids, nil
	}
	return nil, fmt.Errorf("kafka: partitions of %s: %w", topic, err)
}

// subscription is one Subscribe call.
type subscription struct {
	s      *Subscriber
	topic  string
	out    chan *message.Message
	slots  chan struct{} // bounds the records in handlers
	logger watermill.LoggerAdapter

	transport *kafka.Transport

	deliveries deliveryCounter
}

func (sub *subscription) runGroup(ctx context.Context, group *kafka.ConsumerGroup, joined func(error)) {
	defer func() {
		// Ends the current generation, waits for its goroutines and leaves.
		if err := group.Close(); err != nil {
			sub.logger.Error("Closing consumer group failed", err, nil)
		}
	}()
	var failures failureLog
	for {
		gen, err := group.Next(ctx)
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, kafka.ErrGroupClosed) {
				joined(sub.stopped())
				return
			}
			if refused := sub.s.refusal(ctx, sub.transport, err); refused != nil {
				sub.logger.Error("Consumer group refused this member; the subscription ends", refused,
					watermill.LogFields{"code": CodeGroupRefused})
				joined(refused)
				return
			}
			// The group retries by itself after JoinGroupBackoff.
			failures.failed(sub.logger, "Consumer group error; retrying", err,
				watermill.LogFields{"retry_in": sub.s.cfg.JoinGroupBackoff})
			joined(nil)
			continue
		}
		failures.recovered(sub.logger, "Joined the consumer group again", watermill.LogFields{"generation": gen.ID})
		joined(nil)
		sub.startGeneration(ctx, gen)
	}
}

// stopped says why a subscription ended before its first join.
func (sub *subscription) stopped() error {
	select {
	case <-sub.s.closing:
		return ErrSubscriberClosed
	default:
		return fmt.Errorf("kafka: subscribe to %s: %w", sub.topic, context.Canceled)
	}
}

// startGeneration runs one goroutine per assigned partition and a committer,
// all bound to the generation: kafka-go ends the generation when any of them
// returns, and starts no new one until all have returned. That is what makes
// a revoked partition stop before its new owner starts.
func (sub *subscription) startGeneration(ctx context.Context, gen *kafka.Generation) {
	assigned := gen.Assignments[sub.topic]
	c := &committer{
		gen:    gen,
		topic:  sub.topic,
		acked:  map[int]int64{},
		logger: sub.logger.With(watermill.LogFields{"generation": gen.ID}),
	}
	ids := make([]int, 0, len(assigned))
	for _, a := range assigned {
		ids = append(ids, a.ID)
	}
	c.logger.Debug("Partitions assigned", watermill.LogFields{"partitions": ids})

	var partitions sync.WaitGroup
	partitions.Add(len(assigned))
	for _, a := range assigned {
		gen.Start(func(genCtx context.Context) {
			defer partitions.Done()
			pctx, cancel := context.WithCancel(ctx)
			defer cancel()
			stop := context.AfterFunc(genCtx, cancel)
			defer stop()
			sub.consumePartition(pctx, a.ID, a.Offset, c.ack)
		})
	}
	gen.Start(func(genCtx context.Context) {
		c.run(ctx, genCtx, &partitions, sub.s.cfg.CommitInterval)
	})
}

func (sub *subscription) runPartitions(ctx context.Context, partitions []int) {
	var wg sync.WaitGroup
	for _, p := range partitions {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sub.consumePartition(ctx, p, sub.s.cfg.StartOffset, nil)
		}()
	}
	wg.Wait()
}

// committer commits one generation's acked offsets. acked holds, per
// partition, the end of the partition's settled prefix (see partitionRun):
// every record before it is acked or passed over, so committing it never
// skips an unacked message.
type committer struct {
	gen    *kafka.Generation
	topic  string
	logger watermill.LoggerAdapter

	mu        sync.Mutex
	acked     map[int]int64
	committed map[int]int64
}

func (c *committer) ack(partition int, next int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if next > c.acked[partition] {
		c.acked[partition] = next
	}
}

func (c *committer) run(ctx, genCtx context.Context, partitions *sync.WaitGroup, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			c.commit()
		case <-ctx.Done():
			c.final(partitions)
			return
		case <-genCtx.Done():
			c.final(partitions)
			return
		}
	}
}

// final commits what was acked before the partitions stopped. The partition
// goroutines are gone by then, so no ack can slip in after it. During a
// rebalance the coordinator still takes commits from the ending generation;
// if it refuses, the new owner just sees more duplicates.
func (c *committer) final(partitions *sync.WaitGroup) {
	partitions.Wait()
	c.commit()
}

func (c *committer) commit() {
	c.mu.Lock()
	pending := map[int]int64{}
	for p, next := range c.acked {
		if next != c.committed[p] {
			pending[p] = next
		}
	}
	c.mu.Unlock()
	if len(pending) == 0 {
		return
	}
	if err := c.gen.CommitOffsets(map[string]map[int]int64{c.topic: pending}); err != nil {
		c.logger.Info("Committing offsets failed", watermill.LogFields{"err": err, "offsets": pending})
		return
	}
	c.mu.Lock()
	if c.committed == nil {
		c.committed = map[int]int64{}
	}
	for p, next := range pending {
		c.committed[p] = next
	}
	c.mu.Unlock()
}

type topicPartition struct {
	topic     string
	partition int
}

// deliveryCounter counts how often this Subscribe call delivered each
// record that is not acked yet. It outlives generations, so a count survives
// a revoke and reassignment inside this process.
type deliveryCounter struct {
	mu sync.Mutex
	m  map[topicPartition]map[int64]int
}

func (d *deliveryCounter) count(tp topicPartition, offset int64) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.m[tp][offset]
}

func (d *deliveryCounter) set(tp topicPartition, offset int64, n int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.m[tp] == nil {
		d.m[tp] = map[int64]int{}
	}
	d.m[tp][offset] = n
}

func (d *deliveryCounter) forget(tp topicPartition, offset int64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(d.m[tp], offset)
}

// prune forgets the records before start, which were committed: they are
// not delivered again. What is left of a partition is at most the records
// that were unacked when this process last lost it.
func (d *deliveryCounter) prune(tp topicPartition, start int64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for off := range d.m[tp] {
		if off < start {
			delete(d.m[tp], off)
		}
	}
	if len(d.m[tp]) == 0 {
		delete(d.m, tp)
	}
}

// failureLog keeps a run of failures (a broker outage) from being either
// silent or a flood: the first failure is logged at error level, the retries
// that follow at debug level, and again at error level every
// failureRelogInterval while the run lasts.
type failureLog struct {
	count     int
	since     time.Time
	lastError time.Time
}

const failureRelogInterval = 30 * time.Second

func (l *failureLog) failed(logger watermill.LoggerAdapter, msg string, err error, fields watermill.LogFields) {
	now := time.Now()
	if l.count == 0 {
		l.since = now
	}
	l.count++
	if l.count == 1 || now.Sub(l.lastError) >= failureRelogInterval {
		l.lastError = now
		logger.Error(msg, err, fields.Add(watermill.LogFields{"failures": l.count, "failing_for": now.Sub(l.since).Round(time.Millisecond)}))
		return
	}
	logger.Debug(msg, fields.Add(watermill.LogFields{"err": err, "failures": l.count}))
}

func (l *failureLog) recovered(logger watermill.LoggerAdapter, msg string, fields watermill.LogFields) {
	if l.count == 0 {
		return
	}
	logger.Info(msg, fields.Add(watermill.LogFields{"failures": l.count, "failed_for": time.Since(l.since).Round(time.Millisecond)}))
	*l = failureLog{}
}

func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
