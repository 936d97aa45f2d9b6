package chaos_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/chaos"
	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/pgtest"
)

// A child process (internal/childproc) plays a worker that the parent test kills,
// on the parent's schema. Roles:
//
//	consumer: reads one key per line on stdin, runs the payment message through
//	          the flavour's stack (crash middleware outside, idem or the peer
//	          inside) and writes "ack <key>" or "nack <key>" on stdout. It exits 0
//	          at the end of stdin.
//	sender:   sends the due email effects once, then exits 0.
//
// Crash points come from chaos.EnvCrash, as in a user's own test.
var childRoles = map[string]childproc.Role{
	"consumer": func(ctx context.Context, p childproc.Params) error {
		pool, err := childPool(ctx, p["schema"])
		if err != nil {
			return err
		}
		defer pool.Close()
		runConsumerChild(pool, p["schema"], flavour(p["flavour"]))
		return nil
	},
	"sender": func(ctx context.Context, p childproc.Params) error {
		pool, err := childPool(ctx, p["schema"])
		if err != nil {
			return err
		}
		defer pool.Close()
		_, err = sendEmails(ctx, pool, 200*time.Millisecond)
		return err
	},
}

// childWorkers is how many messages a consumer process handles at once.
const childWorkers = 3

func childPool(ctx context.Context, schema string) (*pgxpool.Pool, error) {
	cfg, err := pgtest.ConfigFor(schema, pgtest.Options{MaxConns: childWorkers})
	if err != nil {
		return nil, err
	}
	return pgxpool.NewWithConfig(ctx, cfg)
}

func runConsumerChild(pool *pgxpool.Pool, schema string, f flavour) {
	st := newStack(f, pool, schema, nil, nil)
	defer st.close()
	keys := make(chan string)
	var out sync.Mutex
	var wg sync.WaitGroup
	for range childWorkers {
		wg.Go(func() {
			for key := range keys {
				_, err := st.handler(message.NewMessage(key, paymentPayload(key)))
				answer := "ack"
				if err != nil {
					answer = "nack"
				}
				// os.Stdout is unbuffered: a line written is a line the parent
				// sees, even if the process is killed right after.
				out.Lock()
				fmt.Fprintf(os.Stdout, "%s %s\n", answer, key)
				out.Unlock()
			}
		})
	}
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		keys <- strings.TrimSpace(sc.Text())
	}
	close(keys)
	wg.Wait()
}

// child is a running worker process, seen from the parent.
type child struct {
	id int
	*childproc.Child
}

// childLine is a line a consumer child wrote.
type childLine struct {
	c      *child
	answer string
	key    string
}

// startChild runs a worker process in role on schema, with the flavour f, the crash
// points crash (chaos.EnvCrash) and seed. Lines go to lines (if not nil); exits
// are announced on exits (if not nil).
func startChild(t *testing.T, id int, role, schema string, f flavour, crash string, seed int64,
	lines chan<- childLine, exits chan<- *child) *child {
	t.Helper()
	c := &child{id: id}
	c.Child = childproc.Start(t, role, childproc.Options{
		Params: childproc.Params{"schema": schema, "flavour": string(f)},
		Env:    []string{chaos.EnvCrash + "=" + crash, fmt.Sprintf("%s=%d", chaos.EnvCrashSeed, seed)},
		Stdin:  true,
		OnLine: func(line string) {
			answer, key, _ := strings.Cut(line, " ")
			if lines != nil {
				lines <- childLine{c: c, answer: answer, key: key}
			}
		},
	})
	if exits != nil {
		go func() {
			<-c.Done()
			exits <- c
		}()
	}
	return c
}
