package httpidem_test

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/httpidem"
	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/pgtest"
)

// The crash test runs this test binary again as a child HTTP server
// (internal/childproc) that stops at a chosen point, where the parent kills it with
// SIGKILL. The client then retries against another server, as it would behind a
// load balancer. Its parameters: "point", the crash point, and "schema", the
// parent's schema.
var childRoles = map[string]childproc.Role{"server": runChild}

// Crash points.
const (
	// afterCommit: the transaction committed; the answer was never written.
	afterCommit = "after-commit"
	// midHandler: the payment row is written, not committed.
	midHandler = "mid-handler"
)

// runChild serves the payments routes on a free port, printing "LISTEN <addr>",
// and hangs at the crash point after printing its name.
func runChild(ctx context.Context, p childproc.Params) error {
	schema := p["schema"]
	cfg, err := pgtest.ConfigFor(schema, pgtest.Options{})
	if err != nil {
		return err
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return err
	}
	mw, err := httpidem.New(baseConfig(pool, schema))
	if err != nil {
		return err
	}
	var hook func(http.ResponseWriter, *http.Request) bool
	switch p["point"] {
	case afterCommit:
		httpidem.SetAfterCommit(mw, func(*http.Request) { fmt.Println(afterCommit); select {} })
	case midHandler:
		hook = func(http.ResponseWriter, *http.Request) bool { fmt.Println(midHandler); select {} }
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	fmt.Println("LISTEN", l.Addr())
	srv := &http.Server{Handler: routes(mw, func(w http.ResponseWriter, r *http.Request) { createPayment(w, r, hook) }), ReadHeaderTimeout: 10 * time.Second}
	return srv.Serve(l)
}

// TestSIGKILL: the server process dies by SIGKILL after the commit and before it
// wrote the answer; the retry, on another server, gets the stored answer and no
// second payment. Killed mid-handler instead, nothing committed and the retry
// runs the payment once.
func TestSIGKILL(t *testing.T) {
	t.Parallel()
	for _, point := range []string{afterCommit, midHandler} {
		t.Run(point, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			lines := make(chan string, 4)
			child := childproc.Start(t, "server", childproc.Options{
				Params: childproc.Params{"point": point, "schema": b.schema},
				OnLine: func(l string) { lines <- strings.TrimSpace(l) },
			})
			next := func() string {
				select {
				case l := <-lines:
					return l
				case <-child.Done():
					t.Fatalf("the child exited early (%v)", child.State())
					return ""
				case <-time.After(60 * time.Second):
					t.Fatal("the child said nothing for 60 s")
					return ""
				}
			}
			addr, ok := strings.CutPrefix(next(), "LISTEN ")
			require.True(t, ok)

			errc := make(chan error, 1)
			client := &http.Client{Timeout: 60 * time.Second}
			defer client.CloseIdleConnections()
			go func() {
				_, err := postTo(context.Background(), client, "http://"+addr, "/payments", "crash-key", `{"amount": 42}`, "X-Tenant", "acme")
				errc <- err
			}()
			require.Equal(t, point, next())
			child.KillAndWait(t)
			require.Error(t, <-errc, "the first client never got an answer")

			// The retry reaches a live server. Postgres may take a moment to notice
			// the dead backend of the mid-handler child; the claim waits for it.
			var a answer
			pgtest.WaitFor(t, 60*time.Second, "the retry to be answered", func() bool {
				a = b.post(t, "/payments", "crash-key", `{"amount": 42}`, "X-Tenant", "acme")
				return a.Status != http.StatusConflict // 409: the dead backend still holds the key; retry, as a client does
			})
			require.Equal(t, 1, b.payments(t))
			require.Equal(t, "/payments/"+map[string]string{afterCommit: "1", midHandler: "2"}[point], a.Header.Get("Location"))
			require.Equal(t, http.StatusCreated, a.Status)
			if point == afterCommit {
				require.True(t, a.Replayed, "the stored answer, never run again")
				require.Equal(t, "{\"id\":1,\"amount\":\"42\"}\n", string(a.Body))
				require.Equal(t, "application/json", a.Header.Get("Content-Type"))
				require.EqualValues(t, 0, b.calls.Load())
			} else {
				require.False(t, a.Replayed)
				require.Equal(t, "{\"id\":2,\"amount\":\"42\"}\n", string(a.Body), "id 1 was the killed attempt's")
				require.EqualValues(t, 1, b.calls.Load())
			}
			require.Equal(t, 1, b.count(t, `SELECT count(*) FROM effects`))
		})
	}
}
