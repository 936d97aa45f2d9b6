package effects_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/pgtest"
)

// The table has no notify trigger: Enqueue and EnqueueItems wake the dispatchers
// themselves, once per committed transaction that inserted an effect, with the
// schema as payload; a duplicate, or a rolled-back insert, wakes nobody.
func TestEnqueueNotifiesItself(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := setup(t)
	require.Zero(t, pgtest.Count(t, pool, `SELECT count(*) FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
		JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1 AND NOT t.tgisinternal AND c.relname = 'effects'`, schema),
		"no trigger on the effects table")

	listener, err := pgx.ConnectConfig(ctx, pool.Config().ConnConfig)
	require.NoError(t, err)
	defer func() { require.NoError(t, listener.Close(ctx)) }()
	_, err = listener.Exec(ctx, `LISTEN idem_effects`)
	require.NoError(t, err)
	// notified returns the payloads for this schema that arrive within wait.
	notified := func(wait time.Duration) []string {
		var got []string
		wctx, cancel := context.WithTimeout(ctx, wait)
		defer cancel()
		for {
			n, err := listener.WaitForNotification(wctx)
			if err != nil {
				return got
			}
			if n.Payload == schema { // other tests' schemas share the channel
				got = append(got, n.Payload)
			}
		}
	}
	scope := effectsdb.Scope{Schema: schema}
	enqueue := func(rollback bool, keys ...string) {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		for _, k := range keys {
			_, err := effectsdb.Enqueue(ctx, tx, scope, effectsdb.Effect{Kind: "email", Key: k, Payload: []byte(`{}`)})
			require.NoError(t, err)
		}
		if rollback {
			require.NoError(t, tx.Rollback(ctx))
		} else {
			require.NoError(t, tx.Commit(ctx))
		}
	}
	enqueue(false, "a", "b", "c")
	require.Equal(t, []string{schema}, notified(time.Second), "one notification for the transaction")
	enqueue(false, "a")
	require.Empty(t, notified(300*time.Millisecond), "a duplicate wakes nobody")
	enqueue(true, "z")
	require.Empty(t, notified(300*time.Millisecond), "a rolled-back insert wakes nobody")

	// The set-based write of a group-commit batch.
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := effectsdb.EnqueueItems(ctx, tx, []effectsdb.Item{
			{Scope: scope, Effect: effectsdb.Effect{Kind: "email", Key: "m1", Payload: []byte(`{}`)}},
			{Scope: scope, Effect: effectsdb.Effect{Kind: "email", Key: "m2", Payload: []byte(`{}`)}},
		})
		return err
	})
	require.NoError(t, err)
	require.Equal(t, []string{schema}, notified(time.Second))
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := effectsdb.EnqueueItems(ctx, tx, []effectsdb.Item{{Scope: scope, Effect: effectsdb.Effect{Kind: "email", Key: "m1", Payload: []byte(`{}`)}}})
		return err
	})
	require.NoError(t, err)
	require.Empty(t, notified(300*time.Millisecond), "duplicates only: nobody woken")
}
