package consumer_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/pgtest"
)

// The crash tests re-run this test binary as a child that handles one message and
// stops at a chosen point, where the parent kills it with SIGKILL. The parent then
// redelivers the message, as the broker would, and counts the business rows.
const (
	envCrashRole   = "IDEM_TEST_CRASH_ROLE"
	envCrashSchema = "IDEM_TEST_CRASH_SCHEMA"
	envCrashMode   = "IDEM_TEST_CRASH_MODE"
	envCrashBatch  = "IDEM_TEST_CRASH_BATCH" // "1": a batch handler (HandleBatch)
)

func TestMain(m *testing.M) {
	if role := os.Getenv(envCrashRole); role != "" {
		crashChild(role)
		return
	}
	os.Exit(m.Run())
}

// crashChild handles one message and blocks at the point named by role, printing a
// marker so the parent knows where it is.
func crashChild(role string) {
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	must(err)
	cfg.ConnConfig.RuntimeParams["search_path"] = os.Getenv(envCrashSchema)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	must(err)
	var mode consumer.Mode
	_, err = fmt.Sscan(os.Getenv(envCrashMode), (*int)(&mode))
	must(err)
	c, err := consumer.New(consumer.Config{Name: "payments", Pool: pool, Schema: os.Getenv(envCrashSchema), Mode: mode})
	must(err)
	h := c.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if _, err := consumer.Tx(ctx).Exec(ctx, `INSERT INTO biz (key) VALUES ($1)`, msg.UUID); err != nil {
			return nil, err
		}
		if role == "mid-handler" {
			fmt.Println("IN_HANDLER") // the business row is written but not committed
			select {}
		}
		return nil, nil
	})
	if os.Getenv(envCrashBatch) == "1" {
		bh := c.HandleBatch(func(ctx context.Context, tx pgx.Tx, msgs []*message.Message) error {
			keys := make([]string, len(msgs))
			for i, m := range msgs {
				keys[i] = m.UUID
			}
			if _, err := tx.Exec(ctx, `INSERT INTO biz (key) SELECT unnest($1::text[])`, keys); err != nil {
				return err
			}
			if role == "mid-handler" {
				fmt.Println("IN_HANDLER")
				select {}
			}
			return nil
		})
		h = func(msg *message.Message) ([]*message.Message, error) { return nil, bh(msg) }
	}
	_, err = h(message.NewMessage("pay-crash", []byte(`{}`)))
	must(err)
	fmt.Println("COMMITTED") // committed, not acked: the ack never happens
	select {}
}

func must(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "crash child:", err)
		os.Exit(3)
	}
}

func TestCrash(t *testing.T) {
	t.Parallel()
	type variant struct {
		name  string
		mode  consumer.Mode
		batch bool
	}
	variants := []variant{{"batch-handler", consumer.Transactional, true}}
	for _, mode := range modes {
		variants = append(variants, variant{mode.String(), mode, false})
	}
	for _, point := range []string{"mid-handler", "after-commit-before-ack"} {
		for _, v := range variants {
			mode := v.mode
			t.Run(point+"/"+v.name, func(t *testing.T) {
				t.Parallel()
				c, b := setup(t, mode)
				cmd := exec.Command(os.Args[0], "-test.run=^$")
				batch := "0"
				if v.batch {
					batch = "1"
				}
				cmd.Env = append(os.Environ(), envCrashRole+"="+point, envCrashSchema+"="+b.schema,
					fmt.Sprintf("%s=%d", envCrashMode, int(mode)), envCrashBatch+"="+batch)
				stdout, err := cmd.StdoutPipe()
				require.NoError(t, err)
				cmd.Stderr = os.Stderr
				require.NoError(t, cmd.Start())
				want := map[string]string{"mid-handler": "IN_HANDLER", "after-commit-before-ack": "COMMITTED"}[point]
				reached := make(chan bool, 1)
				go func() {
					sc := bufio.NewScanner(stdout)
					for sc.Scan() {
						if strings.TrimSpace(sc.Text()) == want {
							reached <- true
							return
						}
					}
					reached <- false
				}()
				select {
				case ok := <-reached:
					require.True(t, ok, "child exited before reaching %s", want)
				case <-time.After(60 * time.Second):
					_ = cmd.Process.Kill()
					t.Fatalf("child never reached %s", want)
				}
				require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
				err = cmd.Wait()
				ws := cmd.ProcessState.Sys().(syscall.WaitStatus)
				require.True(t, ws.Signaled() && ws.Signal() == syscall.SIGKILL, "child died by SIGKILL: %v", err)

				// The broker redelivers. Postgres may take a moment to notice the dead
				// backend and roll its transaction back; the claim waits for that.
				h := c.Middleware(b.bizHandler(nil))
				_, err = h(message.NewMessage("pay-crash", []byte(`{}`)))
				require.NoError(t, err)
				require.Equal(t, 1, b.bizRows(t, "pay-crash"), "one commit after the redelivery")
				ranAgain := map[string]int64{"mid-handler": 1, "after-commit-before-ack": 0}[point]
				require.Equal(t, ranAgain, b.calls.Load())
			})
		}
	}
}
