package nats_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats-server/v2/server"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	idemnats "github.com/idemkit/idem/adapters/nats"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// externalURL is NATS_URL: when set, tests also run against that server (for
// example Debian's nats-server 2.9 at nats://127.0.0.1:4222), besides an
// embedded one. The restart tests run embedded only, since they stop the server.
func externalURL() string { return os.Getenv("NATS_URL") }

// startEmbedded starts a JetStream server in the process, storing under dir. The
// server's warnings and errors go to the test's log: an API error such as
// "error creating store for stream" says why only there.
func startEmbedded(t testing.TB, dir string, port int) *server.Server {
	t.Helper()
	s, err := server.NewServer(&server.Options{
		Host:      "127.0.0.1",
		Port:      port,
		JetStream: true,
		StoreDir:  dir,
		NoSigs:    true,
	})
	require.NoError(t, err)
	l := &testLogger{t: t}
	s.SetLoggerV2(l, false, false, false)
	t.Cleanup(l.stop) // registered before the caller's Shutdown: runs after it
	go s.Start()
	require.True(t, s.ReadyForConnections(10*time.Second), "embedded nats-server did not start")
	return s
}

// testLogger writes an embedded server's warnings and errors to the test's log
// until stop, after which (the test is ending) it drops them.
type testLogger struct {
	t       testing.TB
	mu      sync.Mutex
	stopped bool
}

func (l *testLogger) stop() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.stopped = true
}

func (l *testLogger) logf(level, format string, v []any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.stopped {
		l.t.Logf("nats-server %s: %s", level, fmt.Sprintf(format, v...))
	}
}

func (l *testLogger) Noticef(string, ...any)         {}
func (l *testLogger) Debugf(string, ...any)          {}
func (l *testLogger) Tracef(string, ...any)          {}
func (l *testLogger) Warnf(format string, v ...any)  { l.logf("warning", format, v) }
func (l *testLogger) Errorf(format string, v ...any) { l.logf("error", format, v) }
func (l *testLogger) Fatalf(format string, v ...any) { l.logf("fatal", format, v) }

// forEachServer runs fn as a subtest against a fresh embedded server, always,
// and against NATS_URL when that is set. The subtests are named after the
// server ("embedded", "external=nats://host:port") and log which one they use.
func forEachServer(t *testing.T, fn func(t *testing.T, url string)) {
	t.Helper()
	t.Run("embedded", func(t *testing.T) {
		t.Parallel()
		url := embeddedURL(t)
		t.Logf("NATS server: embedded nats-server %s, in process, at %s", server.VERSION, url)
		fn(t, url)
	})
	if u := externalURL(); u != "" {
		t.Run("external="+u, func(t *testing.T) {
			t.Parallel()
			t.Logf("NATS server: external, NATS_URL=%s", u)
			fn(t, u)
		})
	}
}

// embeddedURL starts a fresh embedded server for the test.
func embeddedURL(t testing.TB) string {
	t.Helper()
	s := startEmbedded(t, t.TempDir(), -1)
	t.Cleanup(func() {
		s.Shutdown()
		s.WaitForShutdown()
	})
	return s.ClientURL()
}

// serverURL is the one server a benchmark talks to: NATS_URL, or a fresh
// embedded server.
func serverURL(t testing.TB) string {
	t.Helper()
	if u := externalURL(); u != "" {
		return u
	}
	return embeddedURL(t)
}

func connect(t testing.TB, url string) *natsgo.Conn {
	t.Helper()
	nc, err := natsgo.Connect(url, natsgo.MaxReconnects(-1), natsgo.ReconnectWait(50*time.Millisecond))
	require.NoError(t, err, "cannot reach nats-server at %s; unset NATS_URL to use an embedded server", url)
	t.Cleanup(nc.Close)
	return nc
}

// namespace gives a test its own stream and subject prefix, so that runs and
// parallel tests on a shared server never meet, and deletes the test's streams
// at the end.
func namespace(t testing.TB, url string) (prefix string) {
	t.Helper()
	prefix = "idemtest_" + strings.ReplaceAll(uuid.NewString(), "-", "")[:12] + "_"
	t.Cleanup(func() {
		nc, err := natsgo.Connect(url)
		if err != nil {
			t.Errorf("cleanup: connect: %v", err)
			return
		}
		defer nc.Close()
		js, err := jetstream.New(nc)
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		names := js.StreamNames(ctx)
		var mine []string
		for n := range names.Name() {
			if strings.HasPrefix(n, prefix) {
				mine = append(mine, n)
			}
		}
		for _, n := range mine {
			if err := js.DeleteStream(ctx, n); err != nil {
				t.Errorf("cleanup: delete stream %s: %v", n, err)
			}
		}
	})
	return prefix
}

// topology provisions one stream per topic, named and subjected under prefix.
func topology(prefix string) idemnats.Topology {
	return idemnats.Topology{
		StreamName:    func(topic string) string { return prefix + idemnats.DefaultStreamName(topic) },
		Subject:       func(topic string) string { return prefix + "." + topic },
		AutoProvision: true,
	}
}

func newTopic() string { return "t_" + strings.ReplaceAll(uuid.NewString(), "-", "")[:16] }
