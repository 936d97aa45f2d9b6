package kafka_test

import (
	"context"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/idemkit/idem/adapters/kafka"
)

// Test timings: small enough that rebalances and Close are quick on a
// 2-core CI machine under -race, large enough not to flap.
const (
	testHeartbeat      = 100 * time.Millisecond
	testSessionTimeout = 2 * time.Second
)

// forEachBroker runs fn as a subtest against an in-process kfake cluster,
// always, and against the brokers in KAFKA_BROKERS when that is set. The
// subtests are named after the broker ("kfake", "external=host:port"), and
// each logs which broker it uses, so a run shows where every test ran.
func forEachBroker(t *testing.T, fn func(t *testing.T, brokers []string)) {
	t.Helper()
	t.Run("kfake", func(t *testing.T) {
		t.Parallel()
		brokers := startCluster(t)
		t.Logf("Kafka broker: kfake, in process, at %s", strings.Join(brokers, ","))
		fn(t, brokers)
	})
	if ext := externalBrokers(); ext != nil {
		t.Run(externalName(ext), func(t *testing.T) {
			t.Parallel()
			t.Logf("Kafka broker: external, KAFKA_BROKERS=%s", strings.Join(ext, ","))
			fn(t, ext)
		})
	}
}

func externalName(brokers []string) string { return "external=" + strings.Join(brokers, ",") }

// startCluster runs an in-process kfake cluster and returns its addresses.
func startCluster(t testing.TB) []string {
	t.Helper()
	c, err := kfake.NewCluster(
		kfake.NumBrokers(1),
		// As a broker config, not kfake.GroupMinSessionTimeout: that option
		// is enforced, but DescribeConfigs still reports the 6 s default.
		kfake.BrokerConfigs(map[string]string{"group.min.session.timeout.ms": "100"}),
	)
	require.NoError(t, err)
	t.Cleanup(c.Close)
	return c.ListenAddrs()
}

// externalBrokers returns KAFKA_BROKERS split on commas, or nil.
func externalBrokers() []string {
	v := os.Getenv("KAFKA_BROKERS")
	if v == "" {
		return nil
	}
	return strings.Split(v, ",")
}

func testLogger() watermill.LoggerAdapter {
	if os.Getenv("KAFKA_TEST_DEBUG") != "" {
		return watermill.NewStdLogger(true, true)
	}
	return nil
}

func newPublisher(t testing.TB, brokers []string, key kafka.PartitionKeyFunc) *kafka.Publisher {
	t.Helper()
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{
		WriterConfig: kafkago.WriterConfig{
			Brokers: brokers,
			// kafka-go's 10 s are short for a JVM broker sharing two loaded
			// cores with the tests: a write that times out fails Publish.
			ReadTimeout:  30 * time.Second,
			WriteTimeout: 30 * time.Second,
		},
		PartitionKey: key,
		Logger:       testLogger(),
	})
	require.NoError(t, err)
	return pub
}

func subscriberConfig(brokers []string, group string, partitions int) kafka.SubscriberConfig {
	cfg := kafka.SubscriberConfig{
		TopicPartitions: partitions,
		Logger:          testLogger(),
	}
	cfg.Brokers = brokers
	cfg.GroupID = group
	cfg.HeartbeatInterval = testHeartbeat
	cfg.SessionTimeout = testSessionTimeout
	cfg.NackBackoff = 10 * time.Millisecond
	cfg.TopicReplicationFactor = 1
	return cfg
}

func newSubscriber(t testing.TB, cfg kafka.SubscriberConfig) *kafka.Subscriber {
	t.Helper()
	sub, err := kafka.NewSubscriber(cfg)
	require.NoError(t, err)
	return sub
}

// dropTopicsAtEnd deletes, once t and its subtests are done, the topics that
// topics names at that time from brokers, when brokers are the external ones
// (kfake clusters end with their test). The external broker is shared by
// every test run on the machine and keeps its data: one that has held
// thousands of test topics takes minutes to start and answers metadata
// slowly. Call it before the test starts its publishers and subscribers, so
// that they are closed first. A failed delete is logged, not failed.
func dropTopicsAtEnd(t testing.TB, brokers []string, topics func() []string) {
	t.Helper()
	if !slices.Equal(brokers, externalBrokers()) {
		return
	}
	t.Cleanup(func() {
		names := topics()
		if len(names) == 0 {
			return
		}
		transport := &kafkago.Transport{}
		defer transport.CloseIdleConnections()
		c := &kafkago.Client{Addr: kafkago.TCP(brokers...), Transport: transport, Timeout: 30 * time.Second}
		res, err := c.DeleteTopics(context.Background(), &kafkago.DeleteTopicsRequest{Topics: names})
		if err != nil {
			t.Logf("deleting the test's topics %v: %v", names, err)
			return
		}
		for name, err := range res.Errors {
			if err != nil {
				t.Logf("deleting the test's topic %s: %v", name, err)
			}
		}
	})
}

// topicSet collects the topic names a test uses.
type topicSet struct {
	mu    sync.Mutex
	names []string
}

func (s *topicSet) add(topic string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !slices.Contains(s.names, topic) {
		s.names = append(s.names, topic)
	}
}

func (s *topicSet) list() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.names)
}

// logLine is one line a captureLogger got, with the fields of With.
type logLine struct {
	level  string
	msg    string
	err    error
	fields watermill.LogFields
}

// captureLogger keeps every line for the test to read.
type captureLogger struct {
	mu     *sync.Mutex
	lines  *[]logLine
	fields watermill.LogFields
}

func newCaptureLogger() *captureLogger {
	return &captureLogger{mu: &sync.Mutex{}, lines: &[]logLine{}}
}

func (l *captureLogger) log(level, msg string, err error, fields watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	*l.lines = append(*l.lines, logLine{level, msg, err, l.fields.Add(fields)})
}

func (l *captureLogger) Error(msg string, err error, fields watermill.LogFields) {
	l.log("error", msg, err, fields)
}
func (l *captureLogger) Info(msg string, fields watermill.LogFields) { l.log("info", msg, nil, fields) }
func (l *captureLogger) Debug(msg string, fields watermill.LogFields) {
	l.log("debug", msg, nil, fields)
}
func (l *captureLogger) Trace(msg string, fields watermill.LogFields) {
	l.log("trace", msg, nil, fields)
}
func (l *captureLogger) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return &captureLogger{mu: l.mu, lines: l.lines, fields: l.fields.Add(fields)}
}

// errorLines are the error lines, each "message: error".
func (l *captureLogger) errorLines() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, line := range *l.lines {
		if line.level != "error" {
			continue
		}
		s := line.msg
		if line.err != nil {
			s += ": " + line.err.Error()
		}
		out = append(out, s)
	}
	return out
}

// has reports an error line that starts with prefix.
func (l *captureLogger) has(prefix string) bool {
	return slices.ContainsFunc(l.errorLines(), func(s string) bool { return strings.HasPrefix(s, prefix) })
}

func (l *captureLogger) errorText() string { return strings.Join(l.errorLines(), "\n") }

// pauses returns the lines that announce a pause before the record at
// partition/offset is delivered again, in order.
func (l *captureLogger) pauses(partition int, offset int64) []logLine {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []logLine
	for _, line := range *l.lines {
		if line.fields["retry_in"] != nil && line.fields["partition"] == partition && line.fields["offset"] == offset {
			out = append(out, line)
		}
	}
	return out
}
