package kafka

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/protocol"
	"github.com/segmentio/kafka-go/protocol/fetch"
)

// Fetch defaults, used when the ReaderConfig leaves them at zero. They are
// kafka-go's own.
const (
	defaultMinBytes = 1
	defaultMaxBytes = 1 << 20
)

// Control record types (the second int16 of a control record's key).
const controlAbort = 0

// fetched is one step through a partition: a record to deliver, or a run of
// records that nobody gets (transaction markers, records of aborted
// transactions), which the partition passes over and may commit past.
type fetched struct {
	rec  *kafka.Message // nil: passed over
	next int64          // the offset after this step
}

// partitionFetcher reads one partition with Fetch requests sent through
// kafka-go's Transport, not through kafka.Reader. The Reader hands out
// transaction control records as messages and ignores the aborted
// transactions a read_committed fetch reports, so it delivers markers always
// and aborted records under ReadCommitted. Here every record batch is seen
// with its attributes and producer ID, and only records a consumer should see
// come out.
type partitionFetcher struct {
	transport kafka.RoundTripper
	addr      net.Addr
	topic     string
	partition int
	isolation kafka.IsolationLevel
	minBytes  int32
	maxBytes  int32
	maxWait   time.Duration

	offset int64 // next offset to fetch; kafka.FirstOffset or LastOffset until resolved
	queue  []fetched

	// onReset reports a jump of the fetch position: records deleted by
	// retention before they were read, or a position past the log's end.
	onReset func(from, to int64, why string)
}

func newPartitionFetcher(transport kafka.RoundTripper, cfg kafka.ReaderConfig, topic string, partition int, offset int64) *partitionFetcher {
	return &partitionFetcher{
		transport: transport,
		addr:      kafka.TCP(cfg.Brokers...),
		topic:     topic,
		partition: partition,
		isolation: cfg.IsolationLevel,
		minBytes:  int32(cmp.Or(cfg.MinBytes, defaultMinBytes)),
		maxBytes:  int32(cmp.Or(cfg.MaxBytes, defaultMaxBytes)),
		maxWait:   cfg.MaxWait,
		offset:    offset,
		onReset:   func(int64, int64, string) {},
	}
}

// take returns the partition's next steps, in offset order: the rest of the
// last fetch response, or the next one's. It returns none when a fetch
// brought nothing new. The slice is the caller's.
func (f *partitionFetcher) take(ctx context.Context) ([]fetched, error) {
	if len(f.queue) == 0 {
		if err := f.fetch(ctx); err != nil {
			return nil, err
		}
	}
	steps := f.queue
	f.queue = nil
	return steps, nil
}

func (f *partitionFetcher) fetch(ctx context.Context) error {
	if f.offset < 0 {
		first, last, err := f.bounds(ctx)
		if err != nil {
			return err
		}
		if f.offset == kafka.FirstOffset {
			f.offset = first
		} else {
			f.offset = last
		}
	}

	// The request is bounded by the broker's wait plus a margin, so that a
	// connection lost mid-fetch fails the fetch instead of hanging it.
	rctx, cancel := context.WithTimeout(ctx, f.maxWait+fetchTimeoutMargin)
	defer cancel()
	msg, err := f.transport.RoundTrip(rctx, f.addr, &fetch.Request{
		ReplicaID:      -1,
		MaxWaitTime:    int32(f.maxWait / time.Millisecond),
		MinBytes:       f.minBytes,
		MaxBytes:       f.maxBytes,
		IsolationLevel: int8(f.isolation),
		SessionID:      0,  // no fetch session:
		SessionEpoch:   -1, // a full fetch every time
		Topics: []fetch.RequestTopic{{
			Topic: f.topic,
			Partitions: []fetch.RequestPartition{{
				Partition:          int32(f.partition),
				CurrentLeaderEpoch: -1,
				FetchOffset:        f.offset,
				LogStartOffset:     -1,
				PartitionMaxBytes:  f.maxBytes,
			}},
		}},
	})
	if err != nil {
		return fmt.Errorf("fetch %s/%d at offset %d: %w", f.topic, f.partition, f.offset, err)
	}
	res, ok := msg.(*fetch.Response)
	if !ok {
		return fmt.Errorf("fetch %s/%d: unexpected response %T", f.topic, f.partition, msg)
	}
	if res.ErrorCode != 0 {
		return fmt.Errorf("fetch %s/%d at offset %d: %w", f.topic, f.partition, f.offset, kafka.Error(res.ErrorCode))
	}
	var part *fetch.ResponsePartition
	for i := range res.Topics {
		for j := range res.Topics[i].Partitions {
			if p := &res.Topics[i].Partitions[j]; res.Topics[i].Topic == f.topic && int(p.Partition) == f.partition {
				part = p
			}
		}
	}
	if part == nil {
		return fmt.Errorf("fetch %s/%d: the response has no such partition", f.topic, f.partition)
	}
	if part.ErrorCode != 0 {
		err := kafka.Error(part.ErrorCode)
		if errors.Is(err, kafka.OffsetOutOfRange) {
			return f.outOfRange(ctx)
		}
		return fmt.Errorf("fetch %s/%d at offset %d: %w", f.topic, f.partition, f.offset, err)
	}

	batches, err := f.decode(part)
	if err != nil {
		// The next fetch starts again at f.offset: drop what this one queued,
		// or those records would come twice.
		f.queue = nil
		return fmt.Errorf("fetch %s/%d at offset %d: %w", f.topic, f.partition, f.offset, err)
	}
	if len(f.queue) > 0 {
		f.offset = f.queue[len(f.queue)-1].next
	} else if batches > 0 {
		// Batches came back but none of their records is at or past the
		// fetch position (an empty batch that compaction kept). The broker
		// answers such a fetch at once; pause instead of spinning.
		timer := time.NewTimer(f.maxWait)
		defer timer.Stop()
		select {
		case <-timer.C:
		case <-ctx.Done():
		}
	}
	return nil
}

const fetchTimeoutMargin = 10 * time.Second

// decode queues the partition's records from the fetch position on. It skips
// control batches always, and under ReadCommitted the batches of aborted
// transactions, the way Kafka's own consumer does: the response lists each
// aborted transaction as (producer ID, first offset). From its first offset
// on, that producer's transactional batches are aborted until its abort
// marker. It returns the number of record batches seen.
func (f *partitionFetcher) decode(part *fetch.ResponsePartition) (int, error) {
	stream, ok := part.RecordSet.Records.(*protocol.RecordStream)
	if !ok || stream == nil {
		if part.RecordSet.Records == nil {
			return 0, nil
		}
		// A single reader (not produced by kafka-go's decoder today).
		stream = &protocol.RecordStream{Records: []protocol.RecordReader{part.RecordSet.Records}}
	}

	readCommitted := f.isolation == kafka.ReadCommitted
	pending := part.AbortedTransactions // in first-offset order, as brokers send them
	aborted := map[int64]bool{}
	reach := func(offset int64) {
		for len(pending) > 0 && pending[0].FirstOffset <= offset {
			aborted[pending[0].ProducerID] = true
			pending = pending[1:]
		}
	}

	for _, batch := range stream.Records {
		switch b := batch.(type) {
		case *protocol.ControlBatch:
			if readCommitted && b.ProducerID >= 0 {
				reach(b.BaseOffset)
			}
			for {
				cr, err := b.ReadControlRecord()
				if errors.Is(err, io.EOF) {
					break
				}
				if err != nil {
					return len(stream.Records), fmt.Errorf("control record: %w", err)
				}
				if cr.Type == controlAbort {
					delete(aborted, b.ProducerID)
				}
				f.pass(cr.Offset)
			}
		case *protocol.RecordBatch:
			skip := false
			if readCommitted && b.ProducerID >= 0 {
				reach(b.BaseOffset)
				skip = b.Attributes.Transactional() && aborted[b.ProducerID]
			}
			if err := f.queueRecords(b, skip); err != nil {
				return len(stream.Records), err
			}
		default:
			// Message sets of the v0 and v1 formats: never transactional.
			if err := f.queueRecords(b, false); err != nil {
				return len(stream.Records), err
			}
		}
	}
	return len(stream.Records), nil
}

func (f *partitionFetcher) queueRecords(r protocol.RecordReader, skip bool) error {
	for {
		rec, err := r.ReadRecord()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("record: %w", err)
		}
		if skip {
			closeBytes(rec)
			f.pass(rec.Offset)
			continue
		}
		if rec.Offset < f.offset {
			// A batch can start before the fetch position.
			closeBytes(rec)
			continue
		}
		m, err := f.message(rec)
		closeBytes(rec)
		if err != nil {
			return err
		}
		f.queue = append(f.queue, fetched{rec: m, next: rec.Offset + 1})
	}
}

// pass queues offset as passed over, merged with a run of passed records
// just before it.
func (f *partitionFetcher) pass(offset int64) {
	if offset < f.offset {
		return
	}
	if n := len(f.queue); n > 0 && f.queue[n-1].rec == nil {
		f.queue[n-1].next = offset + 1
		return
	}
	f.queue = append(f.queue, fetched{next: offset + 1})
}

func (f *partitionFetcher) message(rec *protocol.Record) (*kafka.Message, error) {
	key, err := protocol.ReadAll(rec.Key)
	if err != nil {
		return nil, fmt.Errorf("record %d key: %w", rec.Offset, err)
	}
	value, err := protocol.ReadAll(rec.Value)
	if err != nil {
		return nil, fmt.Errorf("record %d value: %w", rec.Offset, err)
	}
	var headers []kafka.Header
	if len(rec.Headers) > 0 {
		headers = make([]kafka.Header, len(rec.Headers))
		copy(headers, rec.Headers)
	}
	return &kafka.Message{
		Topic:     f.topic,
		Partition: f.partition,
		Offset:    rec.Offset,
		Key:       key,
		Value:     value,
		Headers:   headers,
		Time:      rec.Time,
	}, nil
}

func closeBytes(rec *protocol.Record) {
	if rec.Key != nil {
		_ = rec.Key.Close()
	}
	if rec.Value != nil {
		_ = rec.Value.Close()
	}
}

// outOfRange moves a fetch position that the log no longer (or not yet)
// holds, as kafka-go's Reader does for the first case: before the log start
// (retention deleted the records) it goes to the first offset still there;
// past the log end (the log was truncated) it goes to the end, so that new
// records are not skipped. Either way nothing that exists is skipped.
func (f *partitionFetcher) outOfRange(ctx context.Context) error {
	first, last, err := f.bounds(ctx)
	if err != nil {
		return err
	}
	from := f.offset
	switch {
	case from < first:
		f.offset = first
		f.onReset(from, first, "the records before it were deleted (retention) before they were read")
	case from > last:
		f.offset = last
		f.onReset(from, last, "it is past the end of the log")
	}
	// Otherwise the log moved while we asked: fetch again.
	return nil
}

// bounds returns the partition's first offset and its end (the high
// watermark, or the last stable offset under ReadCommitted).
func (f *partitionFetcher) bounds(ctx context.Context) (first, last int64, err error) {
	rctx, cancel := context.WithTimeout(ctx, fetchTimeoutMargin)
	defer cancel()
	c := &kafka.Client{Addr: f.addr, Transport: f.transport}
	res, err := c.ListOffsets(rctx, &kafka.ListOffsetsRequest{
		Topics: map[string][]kafka.OffsetRequest{
			f.topic: {kafka.FirstOffsetOf(f.partition), kafka.LastOffsetOf(f.partition)},
		},
		IsolationLevel: f.isolation,
	})
	if err != nil {
		return 0, 0, fmt.Errorf("list offsets of %s/%d: %w", f.topic, f.partition, err)
	}
	for _, p := range res.Topics[f.topic] {
		if p.Partition != f.partition {
			continue
		}
		if p.Error != nil {
			return 0, 0, fmt.Errorf("list offsets of %s/%d: %w", f.topic, f.partition, p.Error)
		}
		return p.FirstOffset, p.LastOffset, nil
	}
	return 0, 0, fmt.Errorf("list offsets of %s/%d: no answer for the partition", f.topic, f.partition)
}
