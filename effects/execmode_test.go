package effects_test

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/pgtest"
)

// Enqueue, EnqueueMany, the Dispatcher, the ledger sender (into bytea, json, jsonb
// and text columns) and RequeueDead work in every pgx query mode, including exec
// and simple protocol, the modes behind PgBouncer in transaction mode, where pgx
// sends a []byte as bytea whatever the column. Payloads arrive byte for byte.
func TestQueryExecModes(t *testing.T) {
	t.Parallel()
	binary := []byte{0, 0xff, 0xfe, '\\', 'x', '\'', 0x89, 'P', 'N', 'G'}
	doc := []byte(`{"amount": 12.50, "note": "caf\u00e9 \\ 'quoted'"}`)
	for _, qm := range pgtest.QueryExecModes {
		t.Run(qm.String(), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool, schema := pgtest.Setup(t, pgtest.Options{QueryExecMode: qm, MaxConns: 4})
			senders := map[string]effects.Sender{}
			for _, col := range []string{"bytea", "json", "jsonb", "text"} {
				_, err := pool.Exec(ctx, `CREATE TABLE ledger_`+col+` (effect_key text PRIMARY KEY, payload `+col+` NOT NULL)`)
				require.NoError(t, err)
				s, err := effects.NewLedgerSender(effects.LedgerConfig{Pool: pool, Table: schema + ".ledger_" + col})
				require.NoError(t, err)
				senders["ledger-"+col] = s
			}
			rec := newRecorder(func(_ context.Context, d effects.Delivery) error {
				if d.Key == "refused" {
					return effects.Permanent(errors.New("mailbox does not exist"))
				}
				return nil
			})
			senders["mail"] = rec

			tx, err := pool.Begin(ctx)
			require.NoError(t, err)
			scope := effectsdb.Scope{Schema: schema, Source: effectsdb.Source{Consumer: "orders", Key: "o-1"}}
			res, err := effectsdb.Enqueue(ctx, tx, scope, effectsdb.Effect{Kind: "mail", Key: "receipt", Payload: binary})
			require.NoError(t, err)
			require.False(t, res.Duplicate)
			// The same effect again is a no-op; another payload under its key is loud
			// and leaves the transaction usable.
			res, err = effectsdb.Enqueue(ctx, tx, scope, effectsdb.Effect{Kind: "mail", Key: "receipt", Payload: binary})
			require.NoError(t, err)
			require.True(t, res.Duplicate)
			_, err = effectsdb.Enqueue(ctx, tx, scope, effectsdb.Effect{Kind: "mail", Key: "receipt", Payload: doc})
			require.ErrorIs(t, err, effects.ErrFingerprintMismatch)
			_, err = effects.EnqueueMany(effectsdb.WithScope(ctx, scope), tx, []effects.Effect{
				{Kind: "ledger-bytea", Key: "l", Payload: binary},
				{Kind: "ledger-json", Key: "l", Payload: doc},
				{Kind: "ledger-jsonb", Key: "l", Payload: doc},
				{Kind: "ledger-text", Key: "l", Payload: doc},
				{Kind: "mail", Key: "refused", Payload: nil},
			})
			require.NoError(t, err)
			require.NoError(t, tx.Commit(ctx))

			start(t, fastConfig(pool, schema, senders))
			waitState(t, pool, "mail", "receipt", "done", 30*time.Second)
			for _, col := range []string{"bytea", "json", "jsonb", "text"} {
				waitState(t, pool, "ledger-"+col, "l", "done", 30*time.Second)
			}
			waitState(t, pool, "mail", "refused", "dead", 30*time.Second)

			rec.mu.Lock()
			got := rec.sends["receipt"]
			rec.mu.Unlock()
			require.Len(t, got, 1)
			require.True(t, bytes.Equal(binary, got[0].Payload), "sent byte for byte: %x", got[0].Payload)
			var stored []byte
			require.NoError(t, pool.QueryRow(ctx, `SELECT payload FROM ledger_bytea`).Scan(&stored))
			require.True(t, bytes.Equal(binary, stored), "bytea ledger: %x", stored)
			var text, jsonText string
			require.NoError(t, pool.QueryRow(ctx, `SELECT payload FROM ledger_text`).Scan(&text))
			require.Equal(t, string(doc), text)
			require.NoError(t, pool.QueryRow(ctx, `SELECT payload::text FROM ledger_json`).Scan(&jsonText))
			require.Equal(t, string(doc), jsonText, "json keeps the text as sent")
			require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM ledger_jsonb WHERE payload = $1::text::jsonb`, string(doc)))

			n, err := effectsdb.RequeueDead(ctx, pool, schema, effectsdb.RequeueFilter{Kind: "mail"})
			require.NoError(t, err)
			require.EqualValues(t, 1, n)
			waitState(t, pool, "mail", "refused", "dead", 30*time.Second)
			rec.mu.Lock()
			require.Len(t, rec.sends["refused"], 2, "requeued and sent again")
			rec.mu.Unlock()
		})
	}
}
