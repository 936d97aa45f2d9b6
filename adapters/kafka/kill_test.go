package kafka_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// childEnv selects the child role of TestSubscriberKilled and carries
// "brokers,...|topic|group".
const childEnv = "IDEM_KAFKA_KILL_CHILD"

// TestKillChild is the subscriber process that TestSubscriberKilled starts
// and kills. Run on its own it returns at once.
func TestKillChild(t *testing.T) {
	spec := os.Getenv(childEnv)
	if spec == "" {
		return
	}
	parts := strings.Split(spec, "|")
	cfg := subscriberConfig(strings.Split(parts[0], ","), parts[2], 1)
	cfg.SessionTimeout = time.Second
	cfg.RebalanceTimeout = time.Second
	sub := newSubscriber(t, cfg)
	ch, err := sub.Subscribe(context.Background(), parts[1])
	require.NoError(t, err)
	for msg := range ch {
		// Report before acking: a message is either reported here or never
		// acked, so never committed, by this process.
		fmt.Printf("GOT %s\n", msg.UUID)
		time.Sleep(5 * time.Millisecond)
		msg.Ack()
	}
}

// A subscriber process killed with SIGKILL in the middle of its partitions
// commits nothing more; the group's next member gets every message that the
// dead one had not acked and committed.
func TestSubscriberKilled(t *testing.T) {
	t.Parallel()
	forEachBroker(t, func(t *testing.T, brokers []string) {
		const partitions = 2
		b := setup(t, brokers, partitions)
		sent := b.publish(t, 300)

		cmd := exec.Command(os.Args[0], "-test.run=^TestKillChild$", "-test.count=1")
		cmd.Env = append(os.Environ(), childEnv+"="+strings.Join(b.brokers, ",")+"|"+b.topic+"|"+b.group)
		stdout, err := cmd.StdoutPipe()
		require.NoError(t, err)
		var stderr strings.Builder
		cmd.Stderr = &stderr
		require.NoError(t, cmd.Start())

		var mu sync.Mutex
		seenByChild := map[string]bool{}
		enough := make(chan struct{})
		scanDone := make(chan struct{})
		go func() {
			defer close(scanDone)
			s := bufio.NewScanner(stdout)
			for s.Scan() {
				id, ok := strings.CutPrefix(s.Text(), "GOT ")
				if !ok {
					continue
				}
				mu.Lock()
				seenByChild[id] = true
				if len(seenByChild) == 60 {
					close(enough)
				}
				mu.Unlock()
			}
		}()

		select {
		case <-enough:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			t.Fatalf("child consumed too little; stderr:\n%s", stderr.String())
		}
		require.NoError(t, cmd.Process.Kill()) // SIGKILL
		_ = cmd.Wait()
		<-scanDone

		mu.Lock()
		childCount := len(seenByChild)
		mu.Unlock()
		require.Less(t, childCount, len(sent), "the child must die mid-partition")

		c := newCollector()
		_, ch := b.subscribe(t, subscriberConfig(b.brokers, b.group, partitions))
		go c.consume(ch, 0)

		require.Eventually(t, func() bool {
			c.mu.Lock()
			defer c.mu.Unlock()
			for _, m := range sent {
				if !seenByChild[m.UUID] && c.seen[m.UUID] == 0 {
					return false
				}
			}
			return true
		}, 30*time.Second, 20*time.Millisecond)

		c.mu.Lock()
		redelivered := 0
		for id := range c.seen {
			if seenByChild[id] {
				redelivered++
			}
		}
		c.mu.Unlock()
		t.Logf("child saw %d of %d before SIGKILL; survivor redelivered %d of those", childCount, len(sent), redelivered)
	})
}
