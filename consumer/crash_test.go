package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/pgtest"
)

// The crash tests run this test binary again as a child process
// (internal/childproc) that handles one message, or one batch, and stops at a
// chosen point, where the parent kills it with SIGKILL. The parent then redelivers
// the message, as the broker would, and counts the business rows.
//
// The child's parameters: "point" (mid-handler, before-commit or
// after-commit-before-ack), "schema", "mode" (a consumer.Mode), "batch" ("1": a
// batch handler, HandleBatch) and "n", how many messages it sends at once, as one
// batch (1: key "pay-crash"; above 1: keys crashKeys(n)).
var childRoles = map[string]childproc.Role{"crash": crashChild}

// crashKeys are the keys of a child that sends n messages as one batch.
func crashKeys(n int) []string {
	if n <= 1 {
		return []string{"pay-crash"}
	}
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("pay-crash-%d", i)
	}
	return keys
}

// commitBlocker stops the child before it sends a group-commit batch's COMMIT: all
// of the batch's statements have run (the claim, the handlers' writes, the effects),
// and nothing of it is committed.
type commitBlocker struct{}

func (commitBlocker) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, "idem.commit") {
		fmt.Println("BEFORE_COMMIT")
		select {}
	}
	return ctx
}

func (commitBlocker) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func TestMain(m *testing.M) {
	childproc.Main(childRoles)
	os.Exit(m.Run())
}

// crashChild handles one message, or one batch, and blocks at the point named by
// p["point"], printing a marker so the parent knows where it is.
func crashChild(ctx context.Context, p childproc.Params) error {
	role, schema := p["point"], p["schema"]
	cfg, err := pgtest.ConfigFor(schema, pgtest.Options{})
	if err != nil {
		return err
	}
	if role == "before-commit" {
		cfg.ConnConfig.Tracer = commitBlocker{}
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return err
	}
	mode, err := strconv.Atoi(p["mode"])
	if err != nil {
		return err
	}
	n, err := strconv.Atoi(p["n"])
	if err != nil {
		return err
	}
	keys := crashKeys(n)
	ccfg := consumer.Config{Name: "payments", Pool: pool, Schema: schema, Mode: consumer.Mode(mode)}
	if len(keys) > 1 {
		batched(&ccfg) // the messages sent together make one batch
	}
	c, err := consumer.New(ccfg)
	if err != nil {
		return err
	}
	h := c.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if _, err := consumer.Tx(ctx).Exec(ctx, `INSERT INTO biz (key) VALUES ($1)`, msg.UUID); err != nil {
			return nil, err
		}
		// In a batch, the last message's handler stops: the others' rows are
		// written before it, in the same transaction.
		if role == "mid-handler" && msg.UUID == keys[len(keys)-1] {
			fmt.Println("IN_HANDLER") // the business row is written but not committed
			select {}
		}
		return nil, nil
	})
	if p["batch"] == "1" {
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
	msgs := make([]*message.Message, len(keys))
	for i, k := range keys {
		msgs[i] = message.NewMessage(k, []byte(`{}`))
	}
	if err := errors.Join(sendTogether(middlewareFunc(h), msgs...)...); err != nil {
		return err
	}
	fmt.Println("COMMITTED") // committed, not acked: the ack never happens
	select {}
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
				killChildAt(t, point, b.schema, mode, v.batch, 1)

				// The broker redelivers. Postgres may take a moment to notice the dead
				// backend and roll its transaction back; the claim waits for that.
				h := c.Middleware(b.bizHandler(nil))
				_, err := h(message.NewMessage("pay-crash", []byte(`{}`)))
				require.NoError(t, err)
				require.Equal(t, 1, b.bizRows(t, "pay-crash"), "one commit after the redelivery")
				ranAgain := map[string]int64{"mid-handler": 1, "after-commit-before-ack": 0}[point]
				require.Equal(t, ranAgain, b.calls.Load())
			})
		}
	}
}

// killChildAt runs a crash child (n messages sent at once, in mode, through a batch
// handler if batch) and SIGKILLs it when it reports point.
func killChildAt(t *testing.T, point, schema string, mode consumer.Mode, batch bool, n int) {
	t.Helper()
	want := map[string]string{"mid-handler": "IN_HANDLER", "before-commit": "BEFORE_COMMIT", "after-commit-before-ack": "COMMITTED"}[point]
	reached := make(chan struct{})
	var once sync.Once
	child := childproc.Start(t, "crash", childproc.Options{
		Params: childproc.Params{"point": point, "schema": schema, "mode": strconv.Itoa(int(mode)),
			"batch": map[bool]string{false: "0", true: "1"}[batch], "n": strconv.Itoa(n)},
		OnLine: func(line string) {
			if strings.TrimSpace(line) == want {
				once.Do(func() { close(reached) })
			}
		},
	})
	select {
	case <-reached:
	case <-child.Done():
		t.Fatalf("child exited before reaching %s (%v)", want, child.State())
	case <-time.After(60 * time.Second):
		t.Fatalf("child never reached %s", want)
	}
	child.KillAndWait(t)
}

// TestCrashSetBasedBatch SIGKILLs a process in the middle of a set-based batch of
// four messages, in GroupCommit mode and with a batch handler: after the one claim
// statement, while the last handler runs (the others' rows written in the same
// transaction); after every statement of the batch, just before its COMMIT is sent;
// and after the COMMIT, before any ack. The broker redelivers the four together:
// each commits once, and the handlers run again only if nothing had committed.
func TestCrashSetBasedBatch(t *testing.T) {
	t.Parallel()
	const n = 4
	for _, point := range []string{"mid-handler", "before-commit", "after-commit-before-ack"} {
		for _, batch := range []bool{false, true} {
			name := map[bool]string{false: "group-commit", true: "batch-handler"}[batch]
			t.Run(point+"/"+name, func(t *testing.T) {
				t.Parallel()
				var h func(*message.Message) error
				var b *bundle
				var calls func() int64
				if batch {
					var bb *batchBiz
					h, bb, b = setupBatch(t)
					calls = bb.b.calls.Load
				} else {
					var c *consumer.Consumer
					c, b = setup(t, consumer.GroupCommit, batched)
					h = middlewareFunc(c.Middleware(b.bizHandler(nil)))
					calls = b.calls.Load
				}
				mode := map[bool]consumer.Mode{false: consumer.GroupCommit, true: consumer.Transactional}[batch]
				killChildAt(t, point, b.schema, mode, batch, n)

				keys := crashKeys(n)
				committed := pgtest.Count(t, b.pool, `SELECT count(*) FROM biz`)
				if point == "after-commit-before-ack" {
					require.Equal(t, n, committed, "the batch committed before the kill")
					require.Equal(t, 1, pgtest.Count(t, b.pool, `SELECT count(DISTINCT received_at) FROM inbox`),
						"the four committed in one transaction: one batch")
				} else {
					require.Zero(t, committed, "nothing of the batch committed before the kill")
				}
				msgs := make([]*message.Message, n)
				for i, k := range keys {
					msgs[i] = message.NewMessage(k, []byte(`{}`))
				}
				for i, err := range sendTogether(h, msgs...) {
					require.NoError(t, err, keys[i])
				}
				for _, k := range keys {
					require.Equal(t, 1, b.bizRows(t, k), "%s commits once after the redelivery", k)
					state, _ := inboxState(t, b, k)
					require.Equal(t, "completed", state, k)
				}
				ranAgain := map[string]int64{"mid-handler": n, "before-commit": n, "after-commit-before-ack": 0}[point]
				require.Equal(t, ranAgain, calls(), "handler runs after the redelivery")
				wantEffects := n
				if point == "after-commit-before-ack" {
					wantEffects = 0 // the child's handler writes no effect
				}
				require.Equal(t, wantEffects, b.effectRows(t))
			})
		}
	}
}
