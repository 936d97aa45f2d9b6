package kafkagroup

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/pgtest"
)

const (
	// The modes of a member: idem's middleware in Transactional mode, one record
	// of a partition at a time (""); or, with MaxInFlightPerPartition inFlight,
	// the middleware in GroupCommit mode (modeGroup) or a batch handler
	// (modeBatch), each message handled in its own goroutine so that batches form.
	modeGroup = "group-commit"
	modeBatch = "batch"
	inFlight  = 8

	partitions = 6
	batch      = 200 // messages published at each of three points
	messages   = 3 * batch

	// Real session timeouts: a SIGKILLed member's partitions stay where they
	// are until the coordinator has not heard from it for this long. Kafka's
	// default floor is 6 s; the test brokers allow 1 s (scripts/kafka) and
	// 100 ms (kfake here).
	sessionTimeout = 2 * time.Second
	heartbeat      = 200 * time.Millisecond
	handlerDelay   = 5 * time.Millisecond

	deadline = 3 * time.Minute
)

func TestMain(m *testing.M) {
	childproc.Main(map[string]childproc.Role{"member": runMember})
	os.Exit(m.Run())
}

// runMember is one group member, run as a child process (internal/childproc) by
// TestConsumerGroupOfThree. Its parameters: "name", "brokers" (comma-separated),
// "topic", "group", "schema" and "mode" ("", modeGroup or modeBatch).
//
// It prints, for the parent:
//
//	READY                       after Subscribe has joined the group
//	IN p o uuid                 when the handler starts on partition p, offset o
//	HELD p o uuid               after the business row is written, uncommitted,
//	                            in a handler that then blocks (after HOLD on stdin);
//	                            a batch handler prints one for each of its messages
//	ACK p o unixnano uuid       after idem committed, just before the ack
//
// SIGTERM makes it leave the group (Close) and exit.
func runMember(ctx context.Context, params childproc.Params) error {
	name, brokers, topic, group, schema, mode := params["name"], strings.Split(params["brokers"], ","),
		params["topic"], params["group"], params["schema"], params["mode"]

	pcfg, err := pgtest.ConfigFor(schema, pgtest.Options{MaxConns: 4})
	if err != nil {
		return err
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	icfg := consumer.Config{Name: "kafkagroup", Pool: pool, Schema: schema}
	if mode == modeGroup {
		icfg.Mode = consumer.GroupCommit
	}
	idem, err := consumer.New(icfg)
	if err != nil {
		return err
	}

	var hold sync.Mutex
	holdNext := false
	takeHold := func() bool {
		hold.Lock()
		defer hold.Unlock()
		held := holdNext
		holdNext = false
		return held
	}
	go func() {
		s := bufio.NewScanner(os.Stdin)
		for s.Scan() {
			if s.Text() == "HOLD" {
				hold.Lock()
				holdNext = true
				hold.Unlock()
			}
		}
	}()

	handler := idem.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		p, o := msg.Metadata.Get(kafka.MetadataPartition), msg.Metadata.Get(kafka.MetadataOffset)
		fmt.Printf("IN %s %s %s\n", p, o, msg.UUID)
		if _, err := consumer.Tx(ctx).Exec(ctx,
			`INSERT INTO biz (msg_id, member, kafka_partition, kafka_offset) VALUES ($1, $2, $3, $4)`,
			msg.UUID, name, p, o); err != nil {
			return nil, err
		}
		if takeHold() {
			fmt.Printf("HELD %s %s %s\n", p, o, msg.UUID)
			select {} // until SIGKILL: the row is written, not committed
		}
		time.Sleep(handlerDelay)
		return nil, nil
	})
	if mode == modeBatch {
		// The same work for a batch: one INSERT … SELECT FROM unnest.
		bh := idem.HandleBatch(func(ctx context.Context, tx pgx.Tx, msgs []*message.Message) error {
			ids, ps, offs := make([]string, len(msgs)), make([]int32, len(msgs)), make([]int64, len(msgs))
			for i, msg := range msgs {
				p, o := msg.Metadata.Get(kafka.MetadataPartition), msg.Metadata.Get(kafka.MetadataOffset)
				fmt.Printf("IN %s %s %s\n", p, o, msg.UUID)
				pn, err1 := strconv.ParseInt(p, 10, 32)
				on, err2 := strconv.ParseInt(o, 10, 64)
				if err := errors.Join(err1, err2); err != nil {
					return consumer.ForMessage(msg, consumer.Permanent(err))
				}
				ids[i], ps[i], offs[i] = msg.UUID, int32(pn), on
			}
			if _, err := tx.Exec(ctx, `INSERT INTO biz (msg_id, member, kafka_partition, kafka_offset)
				SELECT id, $2, p, o FROM unnest($1::text[], $3::int[], $4::bigint[]) AS u(id, p, o)`,
				ids, name, ps, offs); err != nil {
				return err
			}
			if takeHold() {
				for i, msg := range msgs {
					fmt.Printf("HELD %d %d %s\n", ps[i], offs[i], msg.UUID)
				}
				select {} // until SIGKILL: the batch's rows are written, not committed
			}
			time.Sleep(handlerDelay)
			return nil
		})
		handler = func(msg *message.Message) ([]*message.Message, error) { return nil, bh(msg) }
	}

	cfg := memberConfig(brokers, group)
	if mode != "" {
		cfg.MaxInFlightPerPartition = inFlight
	}
	if os.Getenv("KAFKA_TEST_DEBUG") != "" {
		cfg.Logger = watermill.NewStdLoggerWithOut(os.Stderr, true, false)
	}
	sub, err := kafka.NewSubscriber(cfg)
	if err != nil {
		return err
	}
	ch, err := sub.Subscribe(ctx, topic)
	if err != nil {
		return err
	}
	fmt.Println("READY")
	handle := func(msg *message.Message) {
		if _, err := handler(msg); err != nil {
			fmt.Fprintf(os.Stderr, "member %s: nack %s: %v\n", name, msg.UUID, err)
			msg.Nack()
			return
		}
		fmt.Printf("ACK %s %s %d %s\n", msg.Metadata.Get(kafka.MetadataPartition),
			msg.Metadata.Get(kafka.MetadataOffset), time.Now().UnixNano(), msg.UUID)
		msg.Ack()
	}
	var inflight sync.WaitGroup
	for msg := range ch {
		if mode == "" {
			handle(msg)
			continue
		}
		// The subscriber bounds what is in flight (inFlight per partition).
		inflight.Go(func() { handle(msg) })
	}
	inflight.Wait()
	return errors.Join(sub.Close(), idem.Close())
}

func memberConfig(brokers []string, group string) kafka.SubscriberConfig {
	cfg := kafka.SubscriberConfig{}
	cfg.Brokers = brokers
	cfg.GroupID = group
	cfg.SessionTimeout = sessionTimeout
	cfg.HeartbeatInterval = heartbeat
	cfg.RebalanceTimeout = 3 * time.Second
	cfg.NackBackoff = 50 * time.Millisecond
	return cfg
}

// TestConsumerGroupOfThree runs a group of three member processes behind
// idem's consumer middleware, while members join, leave and are SIGKILLed
// mid-handler, under real session timeouts and rebalances:
//
//   - A, B and C join; A is SIGKILLed holding an uncommitted business row;
//     D joins; B leaves (Close); C is SIGKILLed the same way; E and F join.
//   - Throughout, the group's committed offsets are read (OffsetFetch) every
//     few milliseconds. No offset is ever committed past a message that had
//     not been acked by then: every offset below a committed one has an ACK
//     line written before the commit was seen.
//   - In the end every message has exactly one row in the business table,
//     and the group's offsets stand at each partition's end.
//
// The inflight subtests run the same scenario with MaxInFlightPerPartition
// inFlight, each message in its own goroutine, and members in the batch modes:
// A, D and E run a batch handler, B, C and F the middleware in GroupCommit mode
// (a rolling change of mode, say), so A is killed holding a whole batch's rows and
// C holding a group-commit batch's transaction. Acks then come out of partition
// order, and the committed offset must still stay behind the first unacked one.
func TestConsumerGroupOfThree(t *testing.T) {
	t.Parallel()
	kfakeAddrs := func(t *testing.T) []string {
		c, err := kfake.NewCluster(kfake.NumBrokers(1),
			kfake.BrokerConfigs(map[string]string{"group.min.session.timeout.ms": "100"}))
		require.NoError(t, err)
		t.Cleanup(c.Close)
		t.Logf("Kafka broker: kfake, in process, at %s", strings.Join(c.ListenAddrs(), ","))
		return c.ListenAddrs()
	}
	batchModes := map[string]string{"A": modeBatch, "B": modeGroup, "C": modeGroup, "D": modeBatch, "E": modeBatch, "F": modeGroup}
	t.Run("kfake", func(t *testing.T) {
		t.Parallel()
		runGroup(t, "kfake", kfakeAddrs(t), nil)
	})
	t.Run("kfake-inflight", func(t *testing.T) {
		t.Parallel()
		runGroup(t, "kfake, in flight", kfakeAddrs(t), batchModes)
	})
	if v := os.Getenv("KAFKA_BROKERS"); v != "" {
		t.Run("external="+v, func(t *testing.T) {
			t.Parallel()
			t.Logf("Kafka broker: external, KAFKA_BROKERS=%s", v)
			runGroup(t, "external "+v, strings.Split(v, ","), nil)
		})
		t.Run("external-inflight="+v, func(t *testing.T) {
			t.Parallel()
			t.Logf("Kafka broker: external, KAFKA_BROKERS=%s", v)
			runGroup(t, "external "+v+", in flight", strings.Split(v, ","), batchModes)
		})
	}
}

// runGroup runs the scenario; modes gives each member's mode (nil: all "").
func runGroup(t *testing.T, broker string, brokers []string, modes map[string]string) {
	start := time.Now()
	pool, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 4})
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE biz (msg_id text NOT NULL, member text NOT NULL,
		kafka_partition int NOT NULL, kafka_offset bigint NOT NULL)`)
	require.NoError(t, err)

	topic, group := "kafkagroup-"+uuid.NewString(), "kafkagroup-"+uuid.NewString()
	transport := &kafkago.Transport{MetadataTTL: time.Second}
	t.Cleanup(transport.CloseIdleConnections)
	admin := &kafkago.Client{Addr: kafkago.TCP(brokers...), Transport: transport, Timeout: 10 * time.Second}
	res, err := admin.CreateTopics(ctx, &kafkago.CreateTopicsRequest{Topics: []kafkago.TopicConfig{{
		Topic: topic, NumPartitions: partitions, ReplicationFactor: 1,
	}}})
	require.NoError(t, err)
	require.NoError(t, res.Errors[topic])
	// Delete the topic at the end (after the publisher and members stop): an
	// external broker is shared by every run and keeps its data.
	t.Cleanup(func() {
		if _, err := admin.DeleteTopics(context.Background(), &kafkago.DeleteTopicsRequest{Topics: []string{topic}}); err != nil {
			t.Logf("deleting topic %s: %v", topic, err)
		}
	})

	pub, err := kafka.NewPublisher(kafka.PublisherConfig{
		WriterConfig: kafkago.WriterConfig{Brokers: brokers},
		PartitionKey: kafka.PartitionKeyFromMetadata("key"),
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	var sent []string
	publish := func() {
		msgs := make([]*message.Message, batch)
		for i := range msgs {
			msgs[i] = message.NewMessage(watermill.NewUUID(), []byte(`{}`))
			msgs[i].Metadata.Set("key", strconv.Itoa(len(sent)+i))
			sent = append(sent, msgs[i].UUID)
		}
		require.NoError(t, pub.Publish(topic, msgs...))
	}

	rec := newRecorder()
	run := &groupRun{t: t, brokers: brokers, topic: topic, group: group, schema: schema, rec: rec, modes: modes}

	// Committed offsets, read while the members work, and checked against
	// the acks as they come (a reading is checked once the acks written
	// before it have surely arrived through the pipes).
	sampling, stopSampling := context.WithCancel(ctx)
	samples := &samples{}
	samplerDone := make(chan struct{})
	go func() {
		defer close(samplerDone)
		sampleCommits(sampling, admin, group, topic, samples)
	}()
	defer func() {
		stopSampling()
		<-samplerDone
	}()
	checkCommits := func() error { return verifyCommits(rec, samples.before(time.Now().Add(-2*time.Second))) }

	publish()
	a, b, c := run.start("A"), run.start("B"), run.start("C")
	run.waitAcked(100)
	publish() // so that A has work when it is told to hold
	killedA := run.killMidHandler(a)
	run.start("D")
	run.waitAcked(300)
	run.leave(b)
	publish()
	killedC := run.killMidHandler(c)
	run.start("E")
	run.start("F")

	// Done when every message has its business row and every partition's
	// committed offset is at its end.
	pgtest.WaitFor(t, deadline, "every message committed in biz and every offset committed", func() bool {
		require.NoError(t, checkCommits())
		return pgtest.Count(t, pool, `SELECT count(DISTINCT msg_id) FROM biz`) == messages &&
			committedAtEnd(t, admin, group, topic)
	})
	run.stopAll()
	stopSampling()
	<-samplerDone

	// Once in the business table.
	rows := map[string]int{}
	r, err := pool.Query(ctx, `SELECT msg_id, count(*) FROM biz GROUP BY msg_id`)
	require.NoError(t, err)
	for r.Next() {
		var id string
		var n int
		require.NoError(t, r.Scan(&id, &n))
		rows[id] = n
	}
	require.NoError(t, r.Err())
	for _, id := range sent {
		assert.Equal(t, 1, rows[id], "message %s commits once in biz", id)
	}
	assert.Len(t, rows, messages)

	// The killed members held their rows uncommitted; the business table has
	// each from another member.
	for _, k := range append(slices.Clone(killedA), killedC...) {
		var member string
		require.NoError(t, pool.QueryRow(ctx, `SELECT member FROM biz WHERE msg_id = $1`, k.uuid).Scan(&member))
		assert.NotEqual(t, k.member, member, "the SIGKILLed member's row for %s was never committed", k.uuid)
		assert.False(t, rec.ackedBy(k.member, k.partition, k.offset), "member %s never acked its held message", k.member)
	}
	// With batches, the keys each transaction committed (rows that share a
	// received_at); otherwise the run proved nothing about batches.
	var largest, inBatches int
	require.NoError(t, pool.QueryRow(ctx, `SELECT coalesce(max(n), 0), coalesce(sum(n) FILTER (WHERE n > 1), 0)
		FROM (SELECT count(*) AS n FROM inbox GROUP BY received_at) AS commits`).Scan(&largest, &inBatches))
	if modes != nil {
		assert.Greater(t, largest, 1, "no transaction committed more than one message")
	}

	// No offset is ever committed past a message not yet acked.
	all := samples.before(time.Now())
	require.NoError(t, verifyCommits(rec, all))
	require.NotEmpty(t, all)
	ins, acks := rec.counts()
	t.Logf("%s: %d messages on %d partitions, members A..F (modes %v); %d handler runs, %d acks, %d readings of a committed "+
		"offset that moved, each checked against the acks; killed A (partition %d, %d message(s) held) and C (partition %d, %d held) mid-handler; "+
		"A's held message was acked by another member %s after the kill; %d messages committed in batches (largest %d); took %s",
		broker, messages, partitions, modes, ins, acks, len(all), killedA[0].partition, len(killedA), killedC[0].partition, len(killedC),
		rec.firstAckAfter(killedA[0]).Round(time.Millisecond), inBatches, largest, time.Since(start).Round(time.Millisecond))
}

// groupRun starts and stops member processes and feeds their output to rec.
type groupRun struct {
	t                    *testing.T
	brokers              []string
	topic, group, schema string
	rec                  *recorder
	modes                map[string]string // by member name; nil: all ""
	mu                   sync.Mutex
	members              []*member
}

type member struct {
	name string
	*childproc.Child
	ready chan struct{}
	gone  bool
}

func (r *groupRun) start(name string) *member {
	r.t.Helper()
	m := &member{name: name, ready: make(chan struct{})}
	m.Child = childproc.Start(r.t, "member", childproc.Options{
		Params: childproc.Params{"name": name, "brokers": strings.Join(r.brokers, ","), "topic": r.topic,
			"group": r.group, "schema": r.schema, "mode": r.modes[name]},
		Stdin: true,
		OnLine: func(line string) {
			if line == "READY" {
				close(m.ready)
				return
			}
			r.rec.line(name, line)
		},
	})
	r.mu.Lock()
	r.members = append(r.members, m)
	r.mu.Unlock()
	select {
	case <-m.ready:
	case <-m.Done():
		r.t.Fatalf("member %s exited before it joined: %s", name, m.Output())
	case <-time.After(deadline):
		r.t.Fatalf("member %s did not join within %s", name, deadline)
	}
	return m
}

// held is the message a member held, uncommitted, when it was killed.
type held struct {
	member    string
	partition int
	offset    int64
	uuid      string
	at        time.Time
}

// killMidHandler asks m to hold its next message (or batch) after writing its
// business rows, waits until it does, and SIGKILLs it there. It returns the
// messages held.
func (r *groupRun) killMidHandler(m *member) []held {
	r.t.Helper()
	_, err := io.WriteString(m.Stdin, "HOLD\n")
	require.NoError(r.t, err)
	pgtest.WaitFor(r.t, deadline, "member "+m.name+" holds a message", func() bool {
		return len(r.rec.heldBy(m.name)) > 0
	})
	at := time.Now()
	m.KillAndWait(r.t) // and every HELD line of the batch is in
	h := r.rec.heldBy(m.name)
	for i := range h {
		h[i].at = at
	}
	r.mu.Lock()
	m.gone = true
	r.mu.Unlock()
	return h
}

// leave stops m gracefully: it closes its subscriber, so it leaves the group.
func (r *groupRun) leave(m *member) {
	r.t.Helper()
	m.Stop(r.t, deadline) // it leaves cleanly
	r.mu.Lock()
	m.gone = true
	r.mu.Unlock()
}

func (r *groupRun) stopAll() {
	r.mu.Lock()
	var live []*member
	for _, m := range r.members {
		if !m.gone {
			live = append(live, m)
		}
	}
	r.mu.Unlock()
	for _, m := range live {
		r.leave(m)
	}
}

func (r *groupRun) waitAcked(n int) {
	r.t.Helper()
	pgtest.WaitFor(r.t, deadline, fmt.Sprintf("%d acks", n), func() bool {
		_, acks := r.rec.counts()
		return acks >= n
	})
}

type partOff struct {
	partition int
	offset    int64
}

// recorder collects what the members printed.
type recorder struct {
	mu    sync.Mutex
	acks  map[partOff]time.Time // the earliest ack of each record
	by    map[string]map[partOff]bool
	holds map[string][]held
	ins   int
	nAcks int
}

func newRecorder() *recorder {
	return &recorder{acks: map[partOff]time.Time{}, by: map[string]map[partOff]bool{}, holds: map[string][]held{}}
}

func (r *recorder) line(member, line string) {
	f := strings.Fields(line)
	if len(f) < 4 {
		return
	}
	p, err1 := strconv.Atoi(f[1])
	o, err2 := strconv.ParseInt(f[2], 10, 64)
	if err1 != nil || err2 != nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	switch f[0] {
	case "IN":
		r.ins++
	case "HELD":
		r.holds[member] = append(r.holds[member], held{member: member, partition: p, offset: o, uuid: f[3]})
	case "ACK":
		if len(f) < 5 {
			return
		}
		ns, err := strconv.ParseInt(f[3], 10, 64)
		if err != nil {
			return
		}
		r.nAcks++
		k := partOff{p, o}
		at := time.Unix(0, ns)
		if prev, ok := r.acks[k]; !ok || at.Before(prev) {
			r.acks[k] = at
		}
		if r.by[member] == nil {
			r.by[member] = map[partOff]bool{}
		}
		r.by[member][k] = true
	}
}

func (r *recorder) heldBy(member string) []held {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.holds[member])
}

func (r *recorder) ackedBy(member string, p int, o int64) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.by[member][partOff{p, o}]
}

func (r *recorder) counts() (ins, acks int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.ins, r.nAcks
}

// firstAckAfter is how long after the kill the held message was acked.
func (r *recorder) firstAckAfter(h held) time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.acks[partOff{h.partition, h.offset}].Sub(h.at)
}

// sample is one reading of a partition's committed offset.
type sample struct {
	partition int
	committed int64
	seen      time.Time // when the reading came back: the commit is older
}

// samples are the readings that moved, in the order they were taken.
type samples struct {
	mu   sync.Mutex
	list []sample
}

func (s *samples) add(x sample) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.list = append(s.list, x)
}

func (s *samples) before(t time.Time) []sample {
	s.mu.Lock()
	defer s.mu.Unlock()
	i, _ := slices.BinarySearchFunc(s.list, t, func(x sample, t time.Time) int { return x.seen.Compare(t) })
	return slices.Clone(s.list[:i])
}

func sampleCommits(ctx context.Context, admin *kafkago.Client, group, topic string, out *samples) {
	ps := make([]int, partitions)
	for i := range ps {
		ps[i] = i
	}
	last := map[int]int64{}
	for ctx.Err() == nil {
		res, err := admin.OffsetFetch(ctx, &kafkago.OffsetFetchRequest{GroupID: group, Topics: map[string][]int{topic: ps}})
		seen := time.Now()
		if err == nil {
			for _, p := range res.Topics[topic] {
				if p.Error == nil && p.CommittedOffset > 0 && p.CommittedOffset != last[p.Partition] {
					out.add(sample{p.Partition, p.CommittedOffset, seen})
					last[p.Partition] = p.CommittedOffset
				}
			}
		}
		select {
		case <-ctx.Done():
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// verifyCommits checks each reading: every offset below the committed one
// was acked before the reading came back.
func verifyCommits(rec *recorder, samples []sample) error {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for _, s := range samples {
		for o := range s.committed {
			at, ok := rec.acks[partOff{s.partition, o}]
			if !ok || !at.Before(s.seen) {
				return fmt.Errorf("partition %d: offset %d was committed (read at %s) but offset %d had not been acked by then (acked later: %v, at %s)",
					s.partition, s.committed, s.seen.Format(time.RFC3339Nano), o, ok, at.Format(time.RFC3339Nano))
			}
		}
	}
	return nil
}

// committedAtEnd reports whether the group has committed, on each partition,
// exactly the partition's end (kafka.Lag reads both). The partitions hold
// every message by now.
func committedAtEnd(t *testing.T, admin *kafkago.Client, group, topic string) bool {
	t.Helper()
	lag, err := kafka.Lag(context.Background(), admin, group, topic)
	if err != nil {
		return false
	}
	require.Len(t, lag.Partitions, partitions)
	var records int64
	done := true
	for _, p := range lag.Partitions {
		records += p.EndOffset
		done = done && p.CommittedOffset == p.EndOffset
	}
	require.EqualValues(t, messages, records, "the topic's records")
	return done
}
