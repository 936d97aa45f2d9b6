package effects_test

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/pgtest"
)

func TestEnqueue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.Setup(t)
	scope := effectsdb.Scope{Schema: schema, Source: effectsdb.Source{Consumer: "payments", Key: "pay_789"}}
	enqueue := func(e effects.Effect) (res effects.Result, err error) {
		err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			res, err = effects.Enqueue(effectsdb.WithScope(ctx, scope), tx, e)
			return err
		})
		return res, err
	}
	e := effects.Effect{Kind: "email", Key: "receipt:pay_789", Payload: []byte(`{"to":"a@b.c"}`)}
	res, err := enqueue(e)
	require.NoError(t, err)
	require.False(t, res.Duplicate)

	res, err = enqueue(e)
	require.NoError(t, err)
	require.True(t, res.Duplicate, "same key, same payload: a no-op")

	e2 := e
	e2.Payload = []byte(`{"to":"x@y.z"}`)
	_, err = enqueue(e2)
	require.ErrorIs(t, err, effects.ErrFingerprintMismatch)
	require.Equal(t, "effect_fingerprint_mismatch", inbox.Code(err))

	var state, src string
	var maxAttempts int
	require.NoError(t, pool.QueryRow(ctx, `SELECT state, source_consumer, max_attempts FROM effects WHERE kind='email'`).Scan(&state, &src, &maxAttempts))
	require.Equal(t, "pending", state)
	require.Equal(t, "payments", src)
	require.Equal(t, effects.DefaultMaxAttempts, maxAttempts)
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM effects`))
}

// A duplicate enqueue inside a transaction keeps the transaction usable: the insert
// never raises a unique violation.
func TestEnqueueDuplicateKeepsTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.Setup(t)
	scope := effectsdb.Scope{Schema: schema}
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		e := effects.Effect{Kind: "ledger", Key: "k", Payload: []byte("1")}
		for range 3 {
			if _, err := effects.Enqueue(effectsdb.WithScope(ctx, scope), tx, e); err != nil {
				return err
			}
		}
		_, err := effectsdb.Enqueue(ctx, tx, scope, effectsdb.Effect{Kind: "ledger", Key: "k2", Payload: []byte("2")})
		return err
	})
	require.NoError(t, err)
	require.Equal(t, 2, pgtest.Count(t, pool, `SELECT count(*) FROM effects`))
}

func TestEnqueueValidation(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.Setup(t)
	cases := []struct {
		e     effects.Effect
		scope effectsdb.Scope
		want  error
	}{
		{effects.Effect{Kind: "", Key: "k"}, effectsdb.Scope{}, effects.ErrInvalidKind},
		{effects.Effect{Kind: "has space", Key: "k"}, effectsdb.Scope{}, effects.ErrInvalidKind},
		{effects.Effect{Kind: "email", Key: ""}, effectsdb.Scope{}, effects.ErrInvalidKey},
		{effects.Effect{Kind: "email", Key: strings.Repeat("k", 10*1024)}, effectsdb.Scope{}, effects.ErrInvalidKey},
		{effects.Effect{Kind: "email", Key: "bad\xff"}, effectsdb.Scope{}, effects.ErrInvalidKey},
		{effects.Effect{Kind: "email", Key: "k", Payload: make([]byte, effects.MaxPayloadLen+1)}, effectsdb.Scope{}, effects.ErrPayloadTooLarge},
		{effects.Effect{Kind: "sms", Key: "k"}, effectsdb.Scope{Kinds: []string{"email"}}, effects.ErrUnknownKind},
	}
	for _, tc := range cases {
		tc.scope.Schema = schema
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := effects.Enqueue(effectsdb.WithScope(ctx, tc.scope), tx, tc.e)
			return err
		})
		require.ErrorIs(t, err, tc.want)
		require.NotEmpty(t, inbox.Code(err))
	}
	_, err := effects.Enqueue(ctx, nil, effects.Effect{Kind: "email", Key: "k"})
	require.ErrorIs(t, err, effects.ErrNoTx)
	require.Equal(t, 0, pgtest.Count(t, pool, `SELECT count(*) FROM effects`))
}

func TestEnqueueMissingSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.Setup(t, pgtest.Options{NoMigrate: true})
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := effects.Enqueue(effects.WithScope(ctx, effects.Scope{Schema: schema}), tx, effects.Effect{Kind: "email", Key: "k"})
		return err
	})
	require.ErrorIs(t, err, effects.ErrSchemaMissing)
}

func TestStoredMessageRoundTrip(t *testing.T) {
	t.Parallel()
	e, err := effects.PublishEffect("orders", newMsg())
	require.NoError(t, err)
	require.Equal(t, "publish:orders", e.Kind)
	topic, ok := effectsdb.TopicOf(e.Kind)
	require.True(t, ok)
	require.Equal(t, "orders", topic)
	m, err := effectsdb.DecodeMessage(e.Payload)
	require.NoError(t, err)
	require.Equal(t, e.Key, m.UUID)
	require.Equal(t, "v", m.Metadata.Get("k"))
	require.Equal(t, "body", string(m.Payload))
}

// lockedBuffer is a bytes.Buffer safe for a logger's goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestSchemaBehindANewerMigration: a binary deployed before `idem migrate up`
// meets tables without a column it names (here 005's trace_context). Enqueue and
// the Dispatcher's claim must say so with ErrSchemaMissing and its hint, not a bare
// "column does not exist".
func TestSchemaBehindANewerMigration(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := setup(t)
	_, err := pool.Exec(ctx, `ALTER TABLE effects DROP COLUMN trace_context`) // what 005's down does
	require.NoError(t, err)
	scope := effectsdb.Scope{Schema: schema}

	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := effectsdb.Enqueue(ctx, tx, scope, effectsdb.Effect{Kind: "email", Key: "k"})
		return err
	})
	require.ErrorIs(t, err, effects.ErrSchemaMissing)
	require.Equal(t, "schema_missing", inbox.Code(err))
	require.ErrorContains(t, err, "idem migrate up")

	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := effects.EnqueueMany(effectsdb.WithScope(ctx, scope), tx, []effects.Effect{{Kind: "email", Key: "a"}, {Kind: "email", Key: "b"}})
		return err
	})
	require.ErrorIs(t, err, effects.ErrSchemaMissing)

	var logs lockedBuffer
	// Skipped, NewDispatcher's check would refuse the schema (TestNewChecksTheSchema):
	// the claim finds the column missing instead.
	stop := start(t, effects.Config{Pool: pool, Schema: schema, SkipSchemaCheck: true,
		Senders: map[string]effects.Sender{"email": effects.SenderFunc(func(context.Context, effects.Delivery) error { return nil })},
		Logger:  slog.New(slog.NewTextHandler(&logs, nil))})
	defer stop()
	pgtest.WaitFor(t, 30*time.Second, "the Dispatcher's claim error, naming the cure, in its log", func() bool {
		return strings.Contains(logs.String(), "claim failed") && strings.Contains(logs.String(), "idem migrate up")
	})
}
