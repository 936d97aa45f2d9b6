package kafka

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/segmentio/kafka-go"
)

// GroupLag is how far a consumer group is behind on a topic, as Lag read it.
type GroupLag struct {
	Group string
	Topic string
	// Total is the sum of the partitions' Lag: the records of the topic the
	// group has still to read and commit.
	Total int64
	// Partitions has one entry per partition of the topic, in partition
	// order.
	Partitions []PartitionLag
}

// PartitionLag is how far a consumer group is behind on one partition.
type PartitionLag struct {
	Partition int
	// FirstOffset is the partition's first retained offset: the records
	// before it were deleted by retention (or DeleteRecords).
	FirstOffset int64
	// EndOffset is the partition's end, the offset its next record will get
	// (the high watermark).
	EndOffset int64
	// CommittedOffset is the group's committed offset, the next one it will
	// read; -1 when the group has committed none on this partition.
	CommittedOffset int64
	// Lag is EndOffset minus the offset the group will read next: its
	// CommittedOffset, or FirstOffset when it has committed none or its
	// committed offset was deleted by retention. Never negative: a committed
	// offset past the end (a truncated log) counts 0.
	Lag int64
}

// Lag reads how far group is behind on topic: for each partition, the end
// offset minus the group's committed offset, and their sum. It is what a
// readiness check, a wait for a group to drain before a deploy, or a test
// waiting for a group to catch up needs. The end offsets are read before the
// committed ones, so a Total of 0 means that the group has committed every
// record the topic held when Lag began; a Subscriber commits only acked
// records, so all of them were acked.
//
// A partition on which the group has committed nothing counts from its first
// retained offset, not from 0, since retention may have deleted the head of
// the log: that is where a group with StartOffset kafka.FirstOffset (the
// Subscriber's default) starts. A committed offset that retention has
// deleted since counts from the first retained offset too, where the
// Subscriber resumes. A group that does not exist has committed nothing.
//
// Lag sends three requests through client, which routes them to the
// partition leaders and to the group's coordinator: Metadata (served from
// the transport's metadata cache, so a topic created by another client a
// moment ago may not be known yet), ListOffsets and OffsetFetch. Give it a
// client whose Transport carries the TLS and SASL settings the brokers want,
// as the Subscriber does with its Dialer's:
//
//	client := &kafka.Client{Addr: kafka.TCP(brokers...), Transport: &kafka.Transport{TLS: tlsConfig, SASL: mechanism}}
//
// ctx bounds the call, and so does client.Timeout when set. A topic that
// does not exist, an error of one partition and an error of the group are
// returned with the topic, partition or group they concern, and wrap the
// broker's code: errors.Is(err, kafka.UnknownTopicOrPartition) for a missing
// topic, for example.
func Lag(ctx context.Context, client *kafka.Client, group, topic string) (GroupLag, error) {
	fail := func(format string, args ...any) (GroupLag, error) {
		return GroupLag{}, fmt.Errorf("kafka: lag of group %s on topic %s: "+format, append([]any{group, topic}, args...)...)
	}
	if err := ctx.Err(); err != nil {
		return fail("%w", err)
	}
	md, err := client.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{topic}})
	if err != nil {
		return fail("%w", err)
	}
	i := slices.IndexFunc(md.Topics, func(t kafka.Topic) bool { return t.Name == topic })
	switch {
	case i < 0:
		return fail("the brokers' metadata does not list the topic")
	case md.Topics[i].Error != nil:
		return fail("%w", md.Topics[i].Error)
	case len(md.Topics[i].Partitions) == 0:
		return fail("the topic has no partitions")
	}
	lag := GroupLag{Group: group, Topic: topic}
	var ids []int
	var reqs []kafka.OffsetRequest
	for _, p := range md.Topics[i].Partitions {
		ids = append(ids, p.ID)
		// kafka-go sends each offset request on its own and merges the answers
		// of one partition into one PartitionOffsets.
		reqs = append(reqs, kafka.FirstOffsetOf(p.ID), kafka.LastOffsetOf(p.ID))
	}
	slices.Sort(ids)

	ends, err := client.ListOffsets(ctx, &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{topic: reqs}})
	if err != nil {
		return fail("list offsets: %w", err)
	}
	offsets := map[int]kafka.PartitionOffsets{}
	for _, p := range ends.Topics[topic] {
		if p.Error != nil {
			return fail("partition %d: list offsets: %w", p.Partition, p.Error)
		}
		offsets[p.Partition] = p
	}

	committed, err := client.OffsetFetch(ctx, &kafka.OffsetFetchRequest{GroupID: group, Topics: map[string][]int{topic: ids}})
	if err != nil {
		return fail("fetch committed offsets: %w", err)
	}
	commits := map[int]int64{}
	switch {
	case errors.Is(committed.Error, kafka.GroupIdNotFound):
		// Some brokers (kfake) say so of a group that never committed, where
		// Kafka answers -1 for each partition.
		for _, id := range ids {
			commits[id] = -1
		}
	case committed.Error != nil:
		return fail("fetch committed offsets: %w", committed.Error)
	}
	for _, p := range committed.Topics[topic] {
		if p.Error != nil {
			return fail("partition %d: fetch committed offset: %w", p.Partition, p.Error)
		}
		commits[p.Partition] = p.CommittedOffset
	}

	for _, id := range ids {
		o, ok := offsets[id]
		if !ok {
			return fail("partition %d: list offsets: no answer for the partition", id)
		}
		c, ok := commits[id]
		if !ok {
			return fail("partition %d: fetch committed offset: no answer for the partition", id)
		}
		p := PartitionLag{Partition: id, FirstOffset: o.FirstOffset, EndOffset: o.LastOffset, CommittedOffset: c}
		p.Lag = max(p.EndOffset-max(c, p.FirstOffset), 0)
		lag.Partitions = append(lag.Partitions, p)
		lag.Total += p.Lag
	}
	return lag, nil
}
