package effects_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"time"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/inbox"
)

// Enqueue writes an effect in the caller's transaction. The same kind, key and
// payload again is a duplicate, not an error; the same key with another payload
// is a loud mismatch.
func ExampleEnqueue() {
	pool, schema, closeDB := exampleDB()
	defer closeDB()
	// A consumer or httpidem handler's context carries the scope already; outside
	// them it names the schema ("idem" when there is none).
	ctx := effects.WithScope(context.Background(), effects.Scope{Schema: schema})

	enqueue := func(payload string) {
		tx, err := pool.Begin(ctx)
		if err != nil {
			panic(err)
		}
		defer tx.Rollback(ctx)
		res, err := effects.Enqueue(ctx, tx, effects.Effect{
			Kind: "email", Key: "receipt:pay_789", Payload: []byte(payload),
		})
		if err != nil {
			fmt.Println("error:", inbox.Code(err), errors.Is(err, effects.ErrFingerprintMismatch))
			return
		}
		fmt.Println("duplicate:", res.Duplicate)
		if err := tx.Commit(ctx); err != nil {
			panic(err)
		}
	}
	enqueue(`{"to":"ann@example.com"}`)
	enqueue(`{"to":"ann@example.com"}`)
	enqueue(`{"to":"bob@example.com"}`)
	// Output:
	// duplicate: false
	// duplicate: true
	// error: effect_fingerprint_mismatch true
}

// webhookSender is a custom Sender: it posts each effect to a webhook with the
// effect's key as the Idempotency-Key, so the receiver applies it once however
// often it is sent. A 4xx answer cannot get better by retrying: it is permanent.
type webhookSender struct {
	client *http.Client
	url    string
}

func (s webhookSender) Send(ctx context.Context, d effects.Delivery) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.url, strings.NewReader(string(d.Payload)))
	if err != nil {
		return effects.Permanent(err)
	}
	req.Header.Set("Idempotency-Key", d.Kind+":"+d.Key)
	resp, err := s.client.Do(req)
	if err != nil {
		return effects.Indefinite(err) // it may have arrived: retried with the same key
	}
	defer func() { _ = resp.Body.Close() }()
	switch {
	case resp.StatusCode >= 500:
		return fmt.Errorf("webhook: %s", resp.Status) // transient: retried with backoff
	case resp.StatusCode >= 400:
		return effects.Permanent(fmt.Errorf("webhook: %s", resp.Status))
	}
	return nil
}

// A custom Sender passes the effect's key to its receiver.
func ExampleSender() {
	pool, schema, closeDB := exampleDB()
	defer closeDB()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	got := make(chan string, 1)
	hook := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case got <- r.Header.Get("Idempotency-Key"):
		default: // a repeat: the receiver dedupes it by the key
		}
	}))
	defer hook.Close()

	d, err := effects.NewDispatcher(effects.Config{
		Pool:    pool,
		Schema:  schema,
		Senders: map[string]effects.Sender{"webhook": webhookSender{client: hook.Client(), url: hook.URL}},
		Backoff: effects.Backoff{Initial: 10 * time.Millisecond},
	})
	if err != nil {
		panic(err)
	}
	done := make(chan error)
	go func() { done <- d.Run(ctx) }()

	tx, err := pool.Begin(ctx)
	if err != nil {
		panic(err)
	}
	_, err = effects.Enqueue(effects.WithScope(ctx, effects.Scope{Schema: schema}), tx,
		effects.Effect{Kind: "webhook", Key: "order-shipped:ord_1", Payload: []byte(`{"order":"ord_1"}`)})
	if err != nil {
		panic(err)
	}
	if err := tx.Commit(ctx); err != nil {
		panic(err)
	}

	fmt.Println("Idempotency-Key:", <-got)
	cancel()
	fmt.Println("Run:", <-done)
	// Output:
	// Idempotency-Key: webhook:order-shipped:ord_1
	// Run: <nil>
}
