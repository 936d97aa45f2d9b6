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
//     A handler that runs longer than AckWait keeps its message: the subscriber
//     sends InProgress while the handler holds it.
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
//   - Order: with Concurrency above 1, or after a nack, messages are handled
//     out of stream order.
//   - Advisory-based MaxDeliver reports when no instance is connected: see
//     MaxDelivered and the README.
//
// The connection (*nats.Conn) belongs to the caller; Close on a Publisher or
// Subscriber leaves it open.
package nats
