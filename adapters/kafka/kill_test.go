package kafka_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/pgtest"
)

// subscriberChild is the subscriber process that TestSubscriberKilled starts and
// kills (internal/childproc): it joins the group p["group"] on p["brokers"]
// (comma-separated), reads p["topic"], and writes "GOT <uuid>" for each message
// before it acks it.
func subscriberChild(ctx context.Context, p childproc.Params) error {
	cfg := subscriberConfig(strings.Split(p["brokers"], ","), p["group"], 1)
	cfg.SessionTimeout = time.Second
	cfg.RebalanceTimeout = time.Second
	sub, err := kafka.NewSubscriber(cfg)
	if err != nil {
		return err
	}
	ch, err := sub.Subscribe(ctx, p["topic"])
	if err != nil {
		return err
	}
	for msg := range ch {
		// Report before acking: a message is either reported here or never
		// acked, so never committed, by this process.
		fmt.Printf("GOT %s\n", msg.UUID)
		time.Sleep(5 * time.Millisecond)
		msg.Ack()
	}
	return sub.Close()
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

		var mu sync.Mutex
		seenByChild := map[string]bool{}
		enough := make(chan struct{})
		child := childproc.Start(t, "subscriber", childproc.Options{
			Params: childproc.Params{"brokers": strings.Join(b.brokers, ","), "topic": b.topic, "group": b.group},
			OnLine: func(line string) {
				id, ok := strings.CutPrefix(line, "GOT ")
				if !ok {
					return
				}
				mu.Lock()
				seenByChild[id] = true
				if len(seenByChild) == 60 {
					close(enough)
				}
				mu.Unlock()
			},
		})

		select {
		case <-enough:
		case <-time.After(30 * time.Second):
			t.Fatalf("child consumed too little:\n%s", child.Output())
		}
		child.KillAndWait(t)

		mu.Lock()
		childCount := len(seenByChild)
		mu.Unlock()
		require.Less(t, childCount, len(sent), "the child must die mid-partition")

		c := newCollector()
		_, ch := b.subscribe(t, subscriberConfig(b.brokers, b.group, partitions))
		go c.consume(ch, 0)

		pgtest.WaitFor(t, 30*time.Second, "every message the child did not see, received by the survivor", func() bool {
			c.mu.Lock()
			defer c.mu.Unlock()
			for _, m := range sent {
				if !seenByChild[m.UUID] && c.seen[m.UUID] == 0 {
					return false
				}
			}
			return true
		})

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
