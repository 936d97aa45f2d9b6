package kafka

import (
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/segmentio/kafka-go"
)

// The window of a partition: its records between the commit point and the
// fetch point, and what became of each delivery (see partitionRun).

// windowPerInFlight bounds how far a partition delivers past its oldest
// record not yet acked: its window holds at most windowPerInFlight ×
// MaxInFlightPerPartition records (delivered or not, acked or not) past its
// commit point. A record that stays unacked (a handler that hangs, a record
// nacked again and again) therefore stops its partition after that many
// records, instead of letting it run on until a rebalance redelivers all of
// them. Besides the window, a partition holds at most two fetch responses
// (MaxBytes each): the rest of one, and the next.
const windowPerInFlight = 16

// entryState is where one record of a partition's window stands.
type entryState int8

const (
	// waiting: fetched, not in a handler. A nacked record returns here once
	// its NackBackoff is over.
	waiting entryState = iota
	// inHandler: delivered; neither acked nor nacked yet.
	inHandler
	// backingOff: nacked; waiting NackBackoff before it is delivered again.
	backingOff
	// settled: acked, or passed over (a transaction marker, an aborted
	// record). Its offset may be committed once everything before it is.
	settled
)

// entry is one step of a partition between its commit point and its fetch
// position: a record, or a run of records that nobody gets.
type entry struct {
	rec   *kafka.Message // nil: passed over
	next  int64          // the offset after it
	key   string
	keyed bool // takes part in key order
	state entryState
	index int // in the ready or retries heap; -1 when in neither
	// retrying: in the retries heap, after a nack. It is already one of the
	// partition's unacked records.
	retrying bool
	// nacks counts its nacks in a row, for the pause before its next
	// delivery. It lives as long as the entry: until the record is acked,
	// or its partition revoked.
	nacks int
	// held: its latest nack was for a permanent error
	// (consumer.MetadataErrorPermanent), with heldCode, so it holds the partition
	// until it is acked.
	held     bool
	heldCode string
	// msg is its latest delivery: the one in a handler while inHandler.
	msg *message.Message
}

// readyHeap holds the records that may be delivered now, lowest offset first,
// so that the commit point moves as early as it can.
type readyHeap []*entry

func (h readyHeap) Len() int           { return len(h) }
func (h readyHeap) Less(i, j int) bool { return h[i].rec.Offset < h[j].rec.Offset }
func (h readyHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index = i
	h[j].index = j
}
func (h *readyHeap) Push(x any) {
	e := x.(*entry)
	e.index = len(*h)
	*h = append(*h, e)
}
func (h *readyHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	old[len(old)-1] = nil
	e.index = -1
	*h = old[:len(old)-1]
	return e
}

// outcome is what became of one delivery.
type outcome int8

const (
	acked outcome = iota
	nacked
	retry // the NackBackoff after a nack is over
)

type settlement struct {
	e       *entry
	outcome outcome
	// code is what the handler side put in consumer.MetadataErrorCode before a nack,
	// and permanent whether it set consumer.MetadataErrorPermanent.
	code      string
	permanent bool
}
