package consumer_test

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/pgtest"
)

// Every commit mode works in every pgx query mode. Behind PgBouncer in transaction
// mode users run pgx with QueryExecModeExec or QueryExecModeSimpleProtocol, where
// pgx learns no parameter types from Postgres (a []byte goes as bytea, an array as
// text), so none of idem's statements, pipelines or scans may depend on them.
// Each run: a first delivery commits its row and an effect with a binary payload,
// byte for byte; a duplicate is acked; the same key with another payload is a
// mismatch; a permanent failure is recorded and replayed; a transient one is
// nacked and then succeeds.
func TestQueryExecModes(t *testing.T) {
	t.Parallel()
	binary := []byte{0, 0xff, 0xfe, '\\', 'x', '\'', 0x89, 'P', 'N', 'G'}
	for _, qm := range pgtest.QueryExecModes {
		for _, layout := range []string{"transactional", "group-commit", "lease", "batch-handler"} {
			t.Run(qm.String()+"/"+layout, func(t *testing.T) {
				t.Parallel()
				ctx := context.Background()
				pool, schema := pgtest.Setup(t, pgtest.Options{QueryExecMode: qm, MaxConns: 4})
				_, err := pool.Exec(ctx, `CREATE TABLE biz (id bigserial PRIMARY KEY, key text NOT NULL, payload text)`)
				require.NoError(t, err)
				b := &bundle{pool: pool, schema: schema, reg: prometheus.NewRegistry()}
				cfg := consumer.Config{Name: "payments", Pool: pool, Schema: schema,
					LockTimeout: 2 * time.Second, BusyDelay: time.Millisecond, Registerer: b.reg}

				var mu sync.Mutex
				transientOnce := map[string]bool{"t": true}
				outcome := func(m *message.Message) error {
					mu.Lock()
					defer mu.Unlock()
					switch {
					case m.UUID == "p":
						return consumer.Permanent(errors.New("card declined"))
					case transientOnce[m.UUID]:
						delete(transientOnce, m.UUID)
						return errors.New("provider down")
					}
					return nil
				}
				write := func(ctx context.Context, tx pgx.Tx, m *message.Message) error {
					b.calls.Add(1)
					if _, err := tx.Exec(ctx, `INSERT INTO biz (key, payload) VALUES ($1, $2)`, m.UUID, string(m.Payload)); err != nil {
						return err
					}
					_, err := effects.Enqueue(m.Context(), tx, effects.Effect{Kind: "email", Key: "receipt:" + m.UUID, Payload: binary})
					return err
				}

				var h func(*message.Message) error
				switch layout {
				case "batch-handler":
					batched(&cfg)
					c, err := consumer.New(cfg)
					require.NoError(t, err)
					t.Cleanup(func() { _ = c.Close() })
					h = c.HandleBatch(func(ctx context.Context, tx pgx.Tx, msgs []*message.Message) error {
						var errs []error
						for _, m := range msgs {
							if err := outcome(m); err != nil {
								errs = append(errs, consumer.ForMessage(m, err))
							}
						}
						if len(errs) > 0 {
							return errors.Join(errs...)
						}
						for _, m := range msgs {
							if err := write(ctx, tx, m); err != nil {
								return err
							}
						}
						return nil
					})
				default:
					cfg.Mode = map[string]consumer.Mode{"transactional": consumer.Transactional,
						"group-commit": consumer.GroupCommit, "lease": consumer.Lease}[layout]
					if cfg.Mode == consumer.GroupCommit {
						batched(&cfg)
					}
					c, err := consumer.New(cfg)
					require.NoError(t, err)
					t.Cleanup(func() { _ = c.Close() })
					h = middlewareFunc(c.Middleware(func(m *message.Message) ([]*message.Message, error) {
						if err := outcome(m); err != nil {
							return nil, err
						}
						return nil, write(m.Context(), consumer.Tx(m.Context()), m)
					}))
				}

				// First delivery, then a duplicate, then the key with another payload.
				require.NoError(t, h(newMsg("a", `{"amount": 12.50}`)))
				require.NoError(t, h(newMsg("a", `{"amount": 12.50}`)))
				require.ErrorIs(t, h(newMsg("a", `{"amount": 12.51}`)), consumer.ErrFingerprintMismatch)
				require.Equal(t, 1, b.bizRows(t, "a"))
				require.EqualValues(t, 1, b.counter("idem_inbox_duplicates_total"))
				require.EqualValues(t, 1, b.counter("idem_inbox_fingerprint_mismatch_total"))
				var payload []byte
				var fpLen int
				require.NoError(t, pool.QueryRow(ctx, `SELECT e.payload, length(i.fingerprint) FROM effects e
					JOIN inbox i ON i.key = e.source_key WHERE e.key = 'receipt:a'`).Scan(&payload, &fpLen))
				require.True(t, bytes.Equal(binary, payload), "the effect's payload, byte for byte: %x", payload)
				require.Equal(t, 32, fpLen, "a sha256 fingerprint")

				// A permanent failure is recorded and its redelivery replayed, not run.
				require.NoError(t, h(newMsg("p", `{}`)))
				calls := b.calls.Load()
				require.NoError(t, h(newMsg("p", `{}`)))
				require.Equal(t, calls, b.calls.Load())
				state, code := inboxState(t, b, "p")
				require.Equal(t, "failed", state)
				require.Equal(t, "permanent", code)

				// A transient failure is nacked, and the redelivery commits.
				err = h(newMsg("t", `{}`))
				require.Error(t, err)
				require.False(t, consumer.IsPermanent(err))
				require.NoError(t, h(newMsg("t", `{}`)))
				require.Equal(t, 1, b.bizRows(t, "t"))
				require.Equal(t, 2, b.effectRows(t))
			})
		}
	}
}
