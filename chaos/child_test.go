package chaos_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/chaos"
	"github.com/idemkit/idem/internal/pgtest"
)

// A re-executed test binary plays a worker process that the parent test kills.
// TestMain sends it here when envChild is set. Roles:
//
//	consumer: reads one key per line on stdin, runs the payment message through
//	          the flavour's stack (crash middleware outside, idem or the peer
//	          inside) and writes "ack <key>" or "nack <key>" on stdout. It exits 0
//	          at the end of stdin.
//	sender:   sends the due email effects once, then exits 0.
//
// Crash points come from chaos.EnvCrash, as in a user's own test.
const (
	envSchema  = "IDEM_CHAOS_TEST_SCHEMA"
	envFlavour = "IDEM_CHAOS_TEST_FLAVOUR"
	// childWorkers is how many messages a consumer process handles at once.
	childWorkers = 3
)

func runChild(role string) int {
	ctx := context.Background()
	schema := os.Getenv(envSchema)
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	if err != nil {
		return fail(err)
	}
	cfg.MaxConns = childWorkers
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.ConnConfig.RuntimeParams["application_name"] = "idem-test:" + schema
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return fail(err)
	}
	defer pool.Close()
	switch role {
	case "sender":
		if _, err := sendEmails(ctx, pool, 200*time.Millisecond); err != nil {
			return fail(err)
		}
		return 0
	case "consumer":
		return runConsumerChild(pool, schema, flavour(os.Getenv(envFlavour)))
	}
	return fail(fmt.Errorf("unknown child role %q", role))
}

func fail(err error) int {
	fmt.Fprintln(os.Stderr, "child:", err)
	return 2
}

func runConsumerChild(pool *pgxpool.Pool, schema string, f flavour) int {
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
	return 0
}

// child is a running worker process, seen from the parent.
type child struct {
	id    int
	cmd   *exec.Cmd
	stdin io.WriteCloser
	// exited is closed when the process has ended; state is then set.
	exited chan struct{}
	state  *os.ProcessState
	stderr strings.Builder
}

// childLine is a line a consumer child wrote.
type childLine struct {
	c      *child
	answer string
	key    string
}

// startChild re-executes the test binary in role. Lines go to lines (if not nil);
// exits are announced on exits (if not nil).
func startChild(t *testing.T, id int, role string, env []string, lines chan<- childLine, exits chan<- *child) *child {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), append([]string{envChild + "=" + role}, env...)...)
	c := &child{id: id, cmd: cmd, exited: make(chan struct{})}
	cmd.Stderr = &syncWriter{b: &c.stderr}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	c.stdin = stdin
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			answer, key, _ := strings.Cut(sc.Text(), " ")
			if lines != nil {
				lines <- childLine{c: c, answer: answer, key: key}
			}
		}
		_ = cmd.Wait()
		c.state = cmd.ProcessState
		close(c.exited)
		if exits != nil {
			exits <- c
		}
	}()
	return c
}

// killedBySIGKILL reports whether the process died of SIGKILL.
func (c *child) killedBySIGKILL() bool {
	ws, ok := c.state.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}

func (c *child) wait(t *testing.T, d time.Duration) {
	t.Helper()
	select {
	case <-c.exited:
	case <-time.After(d):
		_ = c.cmd.Process.Kill()
		t.Fatalf("child %d did not end within %s; stderr:\n%s", c.id, d, c.stderrText())
	}
}

func (c *child) stderrText() string {
	w := c.cmd.Stderr.(*syncWriter)
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

type syncWriter struct {
	mu sync.Mutex
	b  *strings.Builder
}

func (w *syncWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func childEnv(schema string, f flavour, crash string, seed int64) []string {
	return []string{
		envSchema + "=" + schema,
		envFlavour + "=" + string(f),
		chaos.EnvCrash + "=" + crash,
		fmt.Sprintf("%s=%d", chaos.EnvCrashSeed, seed),
	}
}
