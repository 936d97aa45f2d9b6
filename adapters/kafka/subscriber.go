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

// ErrSubscriberClosed is returned by Subscribe after Close.
var ErrSubscriberClosed = errors.New("kafka: subscriber closed")

// Subscriber delivers Kafka records as Watermill messages. See the package
// documentation for what it guarantees.
type Subscriber struct {
	cfg    SubscriberConfig
	logger watermill.LoggerAdapter

	mu      sync.Mutex
	closed  bool
	closing chan struct{}
	wg      sync.WaitGroup
}

// NewSubscriber returns a Subscriber. It does not connect until Subscribe.
func NewSubscriber(cfg SubscriberConfig) (*Subscriber, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	return &Subscriber{
		cfg:     cfg,
		logger:  cfg.Logger,
		closing: make(chan struct{}),
	}, nil
}

// Subscribe starts consuming topic. With a GroupID, each call joins the
// group as one member; without, it reads the configured partitions. The
// channel is closed when ctx ends or the Subscriber closes.
//
// Each message must be acked or nacked. The next message of its partition
// is delivered only after that.
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
	defer s.mu.Unlock()
	if s.closed {
		return nil, ErrSubscriberClosed
	}
	ctx, cancel := context.WithCancel(ctx)
	out := make(chan *message.Message)
	sub := &subscription{
		s:      s,
		topic:  topic,
		out:    out,
		slots:  make(chan struct{}, s.cfg.MaxConcurrentPartitions),
		logger: s.logger.With(watermill.LogFields{"topic": topic, "group": s.cfg.GroupID}),

		deliveries: deliveryCounter{m: map[topicPartition]delivery{}},
	}

	var run func(context.Context)
	if s.cfg.GroupID != "" {
		group, err := kafka.NewConsumerGroup(s.groupConfig(topic))
		if err != nil {
			cancel()
			return nil, fmt.Errorf("kafka: consumer group: %w", err)
		}
		run = func(ctx context.Context) { sub.runGroup(ctx, group) }
	} else {
		run = func(ctx context.Context) { sub.runPartitions(ctx, partitions) }
	}

	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer close(out)
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
	return out, nil
}

// SubscribeInitialize creates topic with TopicPartitions partitions and
// TopicReplicationFactor replicas, unless it exists already.
func (s *Subscriber) SubscribeInitialize(topic string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	client := &kafka.Client{Addr: kafka.TCP(s.cfg.Brokers...), Transport: s.transport()}
	defer client.Transport.(*kafka.Transport).CloseIdleConnections()
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
	return nil
}

// Close stops every subscription, waits until their goroutines are gone and
// leaves the consumer groups. Messages in flight are neither acked nor
// committed: the group delivers them again.
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

func (s *Subscriber) transport() *kafka.Transport {
	d := s.cfg.Dialer
	return &kafka.Transport{
		Dial:     d.DialFunc,
		ClientID: d.ClientID,
		TLS:      d.TLS,
		SASL:     d.SASLMechanism,
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
	slots  chan struct{} // bounds partitions with a message in flight
	logger watermill.LoggerAdapter

	deliveries deliveryCounter
}

func (sub *subscription) runGroup(ctx context.Context, group *kafka.ConsumerGroup) {
	for {
		gen, err := group.Next(ctx)
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, kafka.ErrGroupClosed) {
				break
			}
			// The group retries by itself after JoinGroupBackoff.
			sub.logger.Error("Consumer group error", err, nil)
			continue
		}
		sub.startGeneration(ctx, gen)
	}
	// Ends the current generation, waits for its goroutines and leaves.
	if err := group.Close(); err != nil {
		sub.logger.Error("Closing consumer group failed", err, nil)
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

// consumePartition delivers one partition's records in order, one at a time,
// until ctx ends. onAck, if not nil, learns the next offset to commit after
// each ack.
func (sub *subscription) consumePartition(ctx context.Context, partition int, offset int64, onAck func(partition int, next int64)) {
	cfg := sub.s.cfg.ReaderConfig
	r := kafka.NewReader(kafka.ReaderConfig{
		Brokers:          cfg.Brokers,
		Topic:            sub.topic,
		Partition:        partition,
		Dialer:           cfg.Dialer,
		QueueCapacity:    cfg.QueueCapacity,
		MinBytes:         cfg.MinBytes,
		MaxBytes:         cfg.MaxBytes,
		MaxWait:          cfg.MaxWait,
		ReadBatchTimeout: cfg.ReadBatchTimeout,
		ReadBackoffMin:   cfg.ReadBackoffMin,
		ReadBackoffMax:   cfg.ReadBackoffMax,
		MaxAttempts:      cfg.MaxAttempts,
		IsolationLevel:   cfg.IsolationLevel,
		Logger:           cfg.Logger,
		ErrorLogger:      cfg.ErrorLogger,
	})
	defer func() {
		if err := r.Close(); err != nil {
			sub.logger.Debug("Closing partition reader failed", watermill.LogFields{"partition": partition, "err": err})
		}
	}()
	if err := r.SetOffset(offset); err != nil {
		sub.logger.Error("Setting partition offset failed", err, watermill.LogFields{"partition": partition})
		return
	}
	for {
		rec, err := r.FetchMessage(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			sub.logger.Error("Fetching failed", err, watermill.LogFields{"partition": partition})
			if !sleep(ctx, sub.s.cfg.NackBackoff) {
				return
			}
			continue
		}
		if !sub.deliver(ctx, rec) {
			return
		}
		if onAck != nil {
			onAck(partition, rec.Offset+1)
		}
	}
}

// deliver sends rec until it is acked (true), redelivering it after each
// nack, or until ctx ends (false).
func (sub *subscription) deliver(ctx context.Context, rec kafka.Message) bool {
	tp := topicPartition{rec.Topic, rec.Partition}
	for {
		msg := fromRecord(rec, sub.deliveries.next(tp, rec.Offset))
		acked, ok := sub.deliverOnce(ctx, msg)
		if !ok {
			return false
		}
		if acked {
			sub.deliveries.forget(tp, rec.Offset)
			return true
		}
		if !sleep(ctx, sub.s.cfg.NackBackoff) {
			return false
		}
	}
}

func (sub *subscription) deliverOnce(ctx context.Context, msg *message.Message) (acked, ok bool) {
	mctx, cancel := context.WithCancel(ctx)
	defer cancel()
	msg.SetContext(mctx)

	select {
	case sub.slots <- struct{}{}:
	case <-ctx.Done():
		return false, false
	}
	defer func() { <-sub.slots }()

	select {
	case sub.out <- msg:
	case <-ctx.Done():
		return false, false
	}
	select {
	case <-msg.Acked():
		return true, true
	case <-msg.Nacked():
		return false, true
	case <-ctx.Done():
		// Revoked or closing: whatever the handler does now is not recorded,
		// and the record's offset is not committed.
		return false, false
	}
}

// committer commits one generation's acked offsets. acked holds, per
// partition, the offset after the last acked record. A partition delivers one
// record at a time, in order, so that record and every earlier one are acked:
// committing it never skips an unacked message.
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

type delivery struct {
	offset int64
	count  int
}

// deliveryCounter counts how often this process delivered a record. A
// partition has at most one record in flight, so one entry per partition is
// enough, and it survives a revoke and reassignment inside this process.
type deliveryCounter struct {
	mu sync.Mutex
	m  map[topicPartition]delivery
}

func (d *deliveryCounter) next(tp topicPartition, offset int64) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	e := d.m[tp]
	if e.offset != offset || e.count == 0 {
		e = delivery{offset: offset}
	}
	e.count++
	d.m[tp] = e
	return e.count
}

func (d *deliveryCounter) forget(tp topicPartition, offset int64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.m[tp].offset == offset {
		delete(d.m, tp)
	}
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
