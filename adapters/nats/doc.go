// Package nats is a Watermill Publisher and Subscriber on NATS JetStream,
// built on the jetstream package of nats.go, with durable pull consumers and
// explicit acks. It imports only Watermill and nats.go, and is useful without
// the rest of idem.
//
// # What it guarantees
//
//   - A message that Publish reports as published is stored in its stream
//     (sync mode, the default). Its UUID travels as Nats-Msg-Id, so a producer
//     retry within the stream's duplicate window is dropped by the server.
//   - Every stored message is delivered at least once to each durable consumer,
//     until a handler acks it, the handler terminates it (Term), or it reaches
//     MaxDeliver.
//   - A nack is a NakWithDelay, with a delay that grows with the delivery count.
//     A message held longer than AckWait (by a slow handler, or in a batching
//     handler's batch, or waiting for the channel) keeps its message: the
//     subscriber sends InProgress from the moment the message arrives until
//     it is acked or nacked.
//   - One Subscribe call holds up to Concurrency messages (so a batching
//     handler downstream can see that many at once) and asks the server for
//     no more, so none waits in a client buffer. The consumer's MaxAckPending
//     defaults to well above that (DefaultMaxAckPending, or 4 × Concurrency),
//     since it bounds all subscribers of the durable together.
//   - A message that reaches MaxDeliver is never dropped silently: it is
//     logged with its stream sequence, counted, and handed to OnMaxDeliver.
//   - Each delivery carries the stream, consumer, stream sequence, delivery
//     count and store time in its metadata (the Metadata* keys).
//   - The UUID survives between this package and Watermill's own NATS adapter
//     (watermill-nats) both ways: it is written as Nats-Msg-Id and as
//     WatermillUUIDHeader, and read from the first, else the second.
//   - Headers that instruct JetStream about the publish that carried them
//     (Nats-Expected-*, Nats-Batch-*, Nats-Rollup, Nats-TTL, Nats-Incr, the
//     Nats-Schedule directives) are dropped on receipt, so forwarding a message
//     or dead-lettering it never repeats them on another stream.
//
// # What it does not guarantee
//
//   - Exactly-once delivery: a message can arrive twice (a lost ack, an
//     AckWait that ran out, a subscriber closed mid-handler, a producer retry
//     after the duplicate window). idem's inbox turns those into duplicates.
//   - Order. JetStream hands a consumer's messages out in stream order, and
//     a redelivery (a nak whose delay is over, an AckWait that ran out)
//     before any new message, so a redelivered message comes after later
//     ones. With Concurrency 1 the channel gets messages in that order, one
//     at a time; above 1, the messages one Subscribe call holds reach the
//     channel in any order, and subscribers of one durable get disjoint
//     parts of the stream.
//   - Advisory-based MaxDeliver reports when no instance is connected: see
//     MaxDelivered and docs/nats.md.
//
// The connection (*nats.Conn) belongs to the caller; Close on a Publisher or
// Subscriber leaves it open.
package nats
