// Package kafka is a Watermill Publisher and Subscriber for Apache Kafka,
// built on segmentio/kafka-go. It imports Watermill, kafka-go, the Prometheus
// client and OpenTelemetry's propagation API, none of idem's public packages,
// and is useful without the rest of idem.
//
// # What it guarantees
//
// Delivery is at least once:
//
//   - By default (SubscriberConfig.MaxInFlightPerPartition 1) records of one
//     partition are delivered in offset order, one at a time: the next record
//     of a partition is delivered only after the current one is acked. Up to
//     SubscriberConfig.MaxConcurrentPartitions partitions of one Subscribe
//     call have a message in flight at once.
//   - With MaxInFlightPerPartition N above 1, up to N records of a partition
//     are unacked at once (a nacked record waiting for its redelivery
//     counts), and order holds per key: a record is delivered only after
//     every earlier record of its partition with the same key was acked.
//     Records without a key (nil or empty) share one key, so they keep
//     partition order among themselves, unless UnorderedWithoutKey. Of the
//     records that may go, the lowest offset goes first. A partition reads
//     at most 16 × N records past its oldest unacked one.
//   - An offset is committed only after its record, and every earlier record
//     of that partition, has been acked (or passed over, see below): with
//     records acked out of order, the commit is the end of the acked prefix.
//     Commits are coalesced every CommitInterval and flushed when a
//     partition is released (by a revoke or Close), covering every ack given
//     before, but never go past an unacked record.
//   - A nack delivers the same record again after a pause: NackBackoff after
//     its first nack, doubling with each nack of that record in a row, up to
//     NackBackoffMax; an ack or a revoke starts the count again. Each new
//     pause is logged once, with the code in consumer.MetadataErrorCode when the
//     handler side set one. Nothing past the record is committed until it is
//     acked; with N = 1 the partition does not advance meanwhile either, with
//     N > 1 records of other keys go on. Other partitions never wait for it.
//     A nack with consumer.MetadataErrorPermanent (a permanent error: the record can
//     never succeed) makes the record held: that first nack is logged at
//     error level with what to configure (a PoisonQueue, or a key function
//     for a record without a key), and the metrics on
//     SubscriberConfig.Registerer show the partition held, at the record's
//     offset, until it is acked.
//   - When a rebalance revokes a partition, or the Subscriber closes, its
//     delivery stops at once. An ack that arrives afterwards is ignored.
//     The acked prefix is committed one last time; the records in flight,
//     and those acked after an unacked one, are not.
//   - A Publish returns after the broker has acked every record (acks=all),
//     unless PublisherConfig.Async is set. The messages of one Publish call
//     are written in one batch.
//   - Records of transactional producers: a transaction marker (control
//     record) is never delivered, and with IsolationLevel kafka.ReadCommitted
//     neither is a record of an aborted transaction; records after an open
//     transaction wait for its end (Kafka's last stable offset). The offsets
//     passed over are committed like acked ones, so a partition that ends in a
//     marker shows no lag. Partitions are read with Fetch requests through
//     kafka-go's protocol API, because kafka.Reader cannot tell markers and
//     aborted records apart from data.
//   - A consumer group that refuses the member for a reason retrying cannot
//     fix (a SessionTimeout outside the broker's group.min/max.session.timeout.ms,
//     a missing ACL, a full group, ...) is never retried in silence: Subscribe
//     returns a *GroupRefusedError that says what to change, and a refusal
//     after the first join is logged at error level and closes the channel.
//
// # What it does not guarantee
//
// Duplicates are expected, and the idem inbox is what absorbs them:
//
//   - After a rebalance, a crash or a kill -9, the partition's new owner
//     starts at the last committed offset, so it gets again every record that
//     was acked but not yet committed (up to CommitInterval's worth, and with
//     MaxInFlightPerPartition above 1 the records acked after an unacked
//     one), and the ones that were in flight.
//   - A nacked record is delivered again, by design.
//   - A Publish that fails may still have written some records. Publish again
//     with the same message UUIDs.
//   - Order holds within one partition only, and with
//     MaxInFlightPerPartition above 1 within one key of a partition only.
//     Records with the same key go to the same partition; choose the key
//     with PublisherConfig.PartitionKey.
//   - Records deleted by the topic's retention before they were consumed are
//     skipped (kafka-go resumes at the first offset still present).
//
// # Message identity
//
// The message UUID travels in the UUIDHeader header and each metadata entry
// in a header of its own. A record from another producer, without that
// header, arrives with an empty UUID. Its metadata still carries
// MetadataTopic, MetadataPartition and MetadataOffset, so an inbox needs
// either a business key taken from the payload, or the record's position
// ([PartitionOffsetKey]) as its key. Received messages also carry
// MetadataKey, MetadataTimestamp and MetadataDeliveryCount (how many times
// this Subscribe call, so this process, has delivered the record; it counts
// on across a revoke and reassignment in this process until the record is
// committed, and starts again at 1 in another process).
//
// # Consumer groups and groupless reading
//
// With SubscriberConfig.GroupID set, every Subscribe call joins the group as
// one member, through kafka-go's ConsumerGroup and Generation API, and
// returns once it has joined (or was refused, or could not reach the
// coordinator at the first attempt, after which it keeps trying). Without a
// GroupID, Subscribe reads SubscriberConfig.Partitions (all partitions when
// empty) from StartOffset, commits nothing, and starts over on every
// Subscribe: that mode is for tools and tests.
//
// [Lag] reads how far a group is behind on a topic, per partition and in
// all, for readiness checks and for waiting until a group has drained a
// topic.
package kafka
