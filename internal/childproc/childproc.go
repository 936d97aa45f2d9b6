// Package childproc runs a test binary again as a child process that plays a named
// role, so that a test can kill a real process (SIGKILL) at a chosen point and see
// what survives it in the database or the broker.
//
// It is test support: only _test.go files import it, and it imports nothing
// public of idem. A package that starts children calls Main from its TestMain with its roles;
// Start runs the binary again with the role and its parameters in one environment
// variable, EnvChild. A child dies with its parent on Linux (a parent-death
// signal), so a test binary that is killed, or times out, leaves no worker behind.
package childproc

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redact"
)

// EnvChild is the environment variable that makes a test binary a child: it
// holds the role and its parameters, as JSON.
const EnvChild = "IDEM_TEST_CHILD"

// Params are the parameters a parent hands to a child's role.
type Params map[string]string

// A Role is what a child does. Its context ends when the child receives SIGTERM
// or SIGINT. The child exits 0 when the role returns nil; an error is written to
// stderr and the child exits 2. A role that must be killed blocks forever.
type Role func(ctx context.Context, p Params) error

// spec is the content of EnvChild.
type spec struct {
	Role   string `json:"role"`
	Params Params `json:"params,omitempty"`
}

// Main returns at once in a test binary that is not a child. In a child it runs
// the role that EnvChild names, with its parameters, and exits: call it first in
// TestMain.
func Main(roles map[string]Role) {
	v, ok := os.LookupEnv(EnvChild)
	if !ok {
		return
	}
	var s spec
	if err := json.Unmarshal([]byte(v), &s); err != nil {
		fmt.Fprintf(os.Stderr, "child: %s: %v\n", EnvChild, err)
		os.Exit(2)
	}
	role, ok := roles[s.Role]
	if !ok {
		fmt.Fprintf(os.Stderr, "child: unknown role %q\n", s.Role)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	err := role(ctx, s.Params)
	stop()
	if err != nil {
		fmt.Fprintf(os.Stderr, "child %s: %v\n", s.Role, err)
		os.Exit(2)
	}
	os.Exit(0)
}

// Options say how to start a child.
type Options struct {
	// Params are handed to the role.
	Params Params
	// Env adds variables to the child's environment, as "KEY=value" (the
	// environment the code under test reads itself, such as chaos.EnvCrash).
	Env []string
	// Stdin, if set, gives the child a pipe on stdin: Child.Stdin.
	Stdin bool
	// OnLine, if set, receives each line the child writes on stdout, in order,
	// on a goroutine of its own. Without it, stdout is kept with stderr.
	OnLine func(line string)
}

// tailSize is how much of a child's output a Child keeps: the end of it.
const tailSize = 256 << 10

// Child is a running child process, seen from the parent.
type Child struct {
	// Role is the role the child plays.
	Role string
	// Stdin is the child's stdin when Options.Stdin was set.
	Stdin io.WriteCloser
	// Started is when the child was started.
	Started time.Time

	cmd    *exec.Cmd
	done   chan struct{}
	state  *os.ProcessState
	output tail
}

// Start runs the test binary again as a child playing role, and returns it
// running. The child ends with the test: a cleanup kills it if it still runs, and
// logs its output if the test failed.
func Start(tb testing.TB, role string, opts Options) *Child {
	tb.Helper()
	s, err := json.Marshal(spec{Role: role, Params: opts.Params})
	if err != nil {
		tb.Fatal(err)
	}
	// -test.run=^$: if the binary did not call Main, it runs no test rather than
	// every test again.
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(append(os.Environ(), EnvChild+"="+string(s)), opts.Env...)
	dieWithParent(cmd)
	c := &Child{Role: role, cmd: cmd, done: make(chan struct{})}
	cmd.Stderr = &c.output
	var stdout io.Reader
	if opts.OnLine != nil {
		if stdout, err = cmd.StdoutPipe(); err != nil {
			tb.Fatal(err)
		}
	} else {
		cmd.Stdout = &c.output
	}
	if opts.Stdin {
		if c.Stdin, err = cmd.StdinPipe(); err != nil {
			tb.Fatal(err)
		}
	}
	if err := cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	c.Started = time.Now()
	go func() {
		if stdout != nil {
			sc := bufio.NewScanner(stdout)
			for sc.Scan() {
				opts.OnLine(sc.Text())
			}
			_, _ = io.Copy(io.Discard, stdout) // a line too long for the scanner
		}
		_ = cmd.Wait()
		c.state = cmd.ProcessState
		close(c.done)
	}()
	tb.Cleanup(func() {
		select {
		case <-c.done:
		default:
			_ = cmd.Process.Kill()
			<-c.done
		}
		if tb.Failed() {
			tb.Logf("child %s (pid %d, %v) output:\n%s", role, cmd.Process.Pid, c.state, c.Output())
		}
	})
	return c
}

// Pid is the child's process id.
func (c *Child) Pid() int { return c.cmd.Process.Pid }

// Done is closed when the child has ended and its output has been read.
func (c *Child) Done() <-chan struct{} { return c.done }

// Kill sends SIGKILL to the child and returns without waiting for it to end.
func (c *Child) Kill() error { return c.cmd.Process.Kill() }

// Signal sends sig to the child.
func (c *Child) Signal(sig os.Signal) error { return c.cmd.Process.Signal(sig) }

// KillAndWait kills the child with SIGKILL and waits until it has ended. It fails
// the test if the child had ended before, of something else.
func (c *Child) KillAndWait(tb testing.TB) {
	tb.Helper()
	if err := c.Kill(); err != nil && !errors.Is(err, os.ErrProcessDone) {
		tb.Fatalf("kill child %s: %v", c.Role, err)
	}
	<-c.done
	if !c.Killed() {
		tb.Fatalf("child %s ended of something else than the SIGKILL (%v):\n%s", c.Role, c.state, c.Output())
	}
}

// Stop asks the child to end (SIGTERM) and waits up to timeout for it; it fails
// the test unless the child exits 0 in that time.
func (c *Child) Stop(tb testing.TB, timeout time.Duration) {
	tb.Helper()
	if err := c.Signal(syscall.SIGTERM); err != nil && !errors.Is(err, os.ErrProcessDone) {
		tb.Fatalf("stop child %s: %v", c.Role, err)
	}
	c.Wait(tb, timeout)
	if c.ExitCode() != 0 {
		tb.Fatalf("child %s did not exit cleanly on SIGTERM (%v):\n%s", c.Role, c.state, c.Output())
	}
}

// Wait waits up to timeout for the child to end and returns how it ended. It kills
// the child and fails the test at the timeout.
func (c *Child) Wait(tb testing.TB, timeout time.Duration) *os.ProcessState {
	tb.Helper()
	select {
	case <-c.done:
	case <-time.After(timeout):
		_ = c.Kill()
		<-c.done
		tb.Fatalf("child %s did not end within %s:\n%s", c.Role, timeout, c.Output())
	}
	return c.state
}

// State is how the child ended; nil while it runs.
func (c *Child) State() *os.ProcessState {
	select {
	case <-c.done:
		return c.state
	default:
		return nil
	}
}

// Killed reports whether the child has ended of SIGKILL: the parent's, or its own
// (a chaos crash point kills its process with SIGKILL).
func (c *Child) Killed() bool {
	st := c.State()
	if st == nil {
		return false
	}
	ws, ok := st.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}

// ExitCode is the child's exit code: -1 while it runs or if a signal ended it.
func (c *Child) ExitCode() int {
	if st := c.State(); st != nil {
		return st.ExitCode()
	}
	return -1
}

// Output is the end of what the child wrote on stderr (and on stdout, without
// Options.OnLine), with the password of DATABASE_URL masked.
func (c *Child) Output() string { return redact.Text(c.output.String(), os.Getenv("DATABASE_URL")) }

// tail keeps the last tailSize bytes written to it.
type tail struct {
	mu  sync.Mutex
	buf []byte
}

func (t *tail) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf = append(t.buf, p...)
	if over := len(t.buf) - tailSize; over > 0 {
		t.buf = append(t.buf[:0], t.buf[over:]...)
	}
	return len(p), nil
}

func (t *tail) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.buf)
}
