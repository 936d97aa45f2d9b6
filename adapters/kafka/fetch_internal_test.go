package kafka

import (
	"context"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/protocol"
	"github.com/segmentio/kafka-go/protocol/fetch"
	"github.com/stretchr/testify/require"
)

// brokenRecords reads records from offset `from` up to `to`, then fails with
// err (io.EOF: the end).
type brokenRecords struct {
	next, to int64
	err      error
}

func (r *brokenRecords) ReadRecord() (*protocol.Record, error) {
	if r.next >= r.to {
		return nil, r.err
	}
	rec := &protocol.Record{Offset: r.next, Time: time.Unix(0, 0), Value: protocol.NewBytes([]byte("v"))}
	r.next++
	return rec, nil
}

// scriptedFetches answers each Fetch with the next of its record readers.
type scriptedFetches struct {
	readers []protocol.RecordReader
	offsets []int64 // the fetch offsets asked for
}

func (s *scriptedFetches) RoundTrip(_ context.Context, _ net.Addr, m protocol.Message) (protocol.Message, error) {
	req := m.(*fetch.Request)
	s.offsets = append(s.offsets, req.Topics[0].Partitions[0].FetchOffset)
	r := s.readers[0]
	s.readers = s.readers[1:]
	return &fetch.Response{Topics: []fetch.ResponseTopic{{
		Topic:      "t",
		Partitions: []fetch.ResponsePartition{{Partition: 0, RecordSet: protocol.RecordSet{Records: r}}},
	}}}, nil
}

// A fetch whose records fail to decode part-way is retried from the same
// offset, and the records decoded before the failure do not come twice.
func TestFetchDecodeErrorDropsThePartialQueue(t *testing.T) {
	broken := errors.New("corrupt record")
	transport := &scriptedFetches{readers: []protocol.RecordReader{
		&brokenRecords{next: 0, to: 2, err: broken}, // 0, 1, then the error
		&brokenRecords{next: 0, to: 3, err: io.EOF}, // 0, 1, 2
	}}
	f := newPartitionFetcher(transport, kafka.ReaderConfig{Brokers: []string{"x:9092"}, MaxWait: time.Millisecond}, "t", 0, 0)

	_, err := f.take(context.Background())
	require.ErrorIs(t, err, broken)
	var offsets []int64
	for len(offsets) < 3 {
		steps, err := f.take(context.Background())
		require.NoError(t, err)
		for _, s := range steps {
			offsets = append(offsets, s.rec.Offset)
		}
	}
	require.Equal(t, []int64{0, 1, 2}, offsets, "each record once")
	require.Equal(t, []int64{0, 0}, transport.offsets, "the failed fetch is retried from its offset")
}
