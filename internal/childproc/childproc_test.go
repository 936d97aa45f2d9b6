package childproc_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/pgtest"
)

var roles = map[string]childproc.Role{
	// echo writes its "greeting" parameter, then each line of stdin upper-cased,
	// and exits 0 at the end of stdin.
	"echo": func(_ context.Context, p childproc.Params) error {
		fmt.Println(p["greeting"])
		sc := bufio.NewScanner(os.Stdin)
		for sc.Scan() {
			fmt.Println(strings.ToUpper(sc.Text()))
		}
		return nil
	},
	// hang says READY and blocks until it is killed.
	"hang": func(context.Context, childproc.Params) error {
		fmt.Println("READY")
		select {}
	},
	// serve says READY and returns when its context ends (SIGTERM).
	"serve": func(ctx context.Context, _ childproc.Params) error {
		fmt.Println("READY")
		<-ctx.Done()
		return nil
	},
	// say writes its "text" parameter on stderr.
	"say": func(_ context.Context, p childproc.Params) error {
		fmt.Fprintln(os.Stderr, p["text"])
		return nil
	},
	// fail returns an error.
	"fail": func(context.Context, childproc.Params) error { return errors.New("it went wrong") },
}

func TestMain(m *testing.M) {
	childproc.Main(roles)
	os.Exit(m.Run())
}

// lines collects what a child writes on stdout.
type lines struct {
	mu  sync.Mutex
	got []string
}

func (l *lines) add(s string) { l.mu.Lock(); l.got = append(l.got, s); l.mu.Unlock() }

func (l *lines) has(s string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, g := range l.got {
		if g == s {
			return true
		}
	}
	return false
}

func TestParamsStdinAndLines(t *testing.T) {
	t.Parallel()
	var out lines
	c := childproc.Start(t, "echo", childproc.Options{Params: childproc.Params{"greeting": "hello"}, Stdin: true, OnLine: out.add})
	_, err := c.Stdin.Write([]byte("one\ntwo\n"))
	require.NoError(t, err)
	require.NoError(t, c.Stdin.Close())
	st := c.Wait(t, 30*time.Second)
	require.Equal(t, 0, st.ExitCode(), c.Output())
	require.Equal(t, []string{"hello", "ONE", "TWO"}, out.got)
	require.False(t, c.Killed())
}

func TestKillAndWait(t *testing.T) {
	t.Parallel()
	var out lines
	c := childproc.Start(t, "hang", childproc.Options{OnLine: out.add})
	pgtest.WaitFor(t, 30*time.Second, "the child to say READY", func() bool { return out.has("READY") })
	require.Nil(t, c.State(), "running")
	require.Equal(t, -1, c.ExitCode())
	c.KillAndWait(t)
	require.True(t, c.Killed())
}

func TestStopEndsTheRolesContext(t *testing.T) {
	t.Parallel()
	var out lines
	c := childproc.Start(t, "serve", childproc.Options{OnLine: out.add})
	pgtest.WaitFor(t, 30*time.Second, "the child to say READY", func() bool { return out.has("READY") })
	c.Stop(t, 30*time.Second)
	require.Equal(t, 0, c.ExitCode())
}

func TestFailingRoleExits2(t *testing.T) {
	t.Parallel()
	c := childproc.Start(t, "fail", childproc.Options{})
	require.Equal(t, 2, c.Wait(t, 30*time.Second).ExitCode())
	require.Contains(t, c.Output(), "child fail: it went wrong")
}

func TestUnknownRoleExits2(t *testing.T) {
	t.Parallel()
	c := childproc.Start(t, "nobody", childproc.Options{})
	require.Equal(t, 2, c.Wait(t, 30*time.Second).ExitCode())
	require.Contains(t, c.Output(), `unknown role "nobody"`)
}

// TestOutputMasksThePassword: what a child says about DATABASE_URL comes back
// with the password masked.
func TestOutputMasksThePassword(t *testing.T) {
	t.Setenv("DATABASE_URL", "postgres://u:s3cret@127.0.0.1:1/db")
	c := childproc.Start(t, "say", childproc.Options{Params: childproc.Params{"text": "dial postgres://u:s3cret@127.0.0.1:1/db: refused"}})
	require.Equal(t, 0, c.Wait(t, 30*time.Second).ExitCode())
	require.Contains(t, c.Output(), "dial postgres://u:")
	require.NotContains(t, c.Output(), "s3cret")
}
