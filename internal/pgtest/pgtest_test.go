package pgtest

import (
	"fmt"
	"runtime"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// recorder is a testing.TB whose Fatal and Error record the message, so a test
// can read what a failing helper would have printed. Fatal ends the goroutine, as
// testing's does: run each helper through call.
type recorder struct {
	testing.TB
	msgs []string
}

func (r *recorder) call(f func()) {
	done := make(chan struct{})
	go func() { defer close(done); f() }()
	<-done
}

func (r *recorder) Helper() {}
func (r *recorder) Fatal(args ...any) {
	r.msgs = append(r.msgs, fmt.Sprint(args...))
	runtime.Goexit()
}
func (r *recorder) Error(args ...any)                 { r.msgs = append(r.msgs, fmt.Sprint(args...)) }
func (r *recorder) Fatalf(format string, args ...any) { r.Fatal(fmt.Sprintf(format, args...)) }
func (r *recorder) Errorf(format string, args ...any) { r.Error(fmt.Sprintf(format, args...)) }

// A failing test never prints the password of DATABASE_URL: neither Require's
// "not reachable at" message nor the helpers' connection failures.
func TestFailuresHideThePassword(t *testing.T) {
	const secret = "pgtest-s3cret-pw"
	t.Setenv("DATABASE_URL", "postgres://postgres:"+secret+"@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=2")

	msg := unreachable(URL(), ping(URL()))
	require.Contains(t, msg, "Postgres is not reachable at postgres://postgres:xxxxx@127.0.0.1:1/postgres")
	require.Contains(t, msg, "docker compose up -d postgres")
	require.NotContains(t, msg, secret)

	rec := &recorder{TB: t}
	pool := NewPool(rec, "t_nowhere", 1)
	rec.call(func() { Count(rec, pool, `SELECT 1`) })
	rec.call(func() { TerminateBackends(rec, "t_nowhere") })
	rec.call(func() { DropSchema(rec, "t_nowhere") })
	require.Len(t, rec.msgs, 3, "each helper failed: %q", rec.msgs)
	for _, m := range rec.msgs {
		require.NotContains(t, m, secret)
		require.True(t, strings.Contains(m, "127.0.0.1") || strings.Contains(m, "connect"), m)
	}
}
