package consumer_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
)

// A batch handler writes a whole batch's ledger rows with one INSERT … SELECT FROM
// unnest, and names the message it cannot decode. Four payments arrive together,
// one of them twice and one undecodable: three ledger rows, three receipt effects,
// and one recorded failure.
func ExampleConsumer_HandleBatch() {
	pool, schema, cleanup := exampleDB(`CREATE TABLE ledger (payment text PRIMARY KEY, amount bigint)`)
	defer cleanup()
	ctx := context.Background()

	idem, err := consumer.New(consumer.Config{Name: "payments", Pool: pool, Schema: schema, Batch: consumer.BatchConfig{MaxBatch: 256}})
	if err != nil {
		panic(err)
	}
	defer func() { _ = idem.Close() }()
	handler := idem.HandleBatch(func(ctx context.Context, tx pgx.Tx, msgs []*message.Message) error {
		var ids []string
		var amounts []int64
		var failed []error
		for _, m := range msgs {
			var p struct{ Amount int64 }
			if err := json.Unmarshal(m.Payload, &p); err != nil {
				failed = append(failed, consumer.ForMessage(m, consumer.Permanent(err)))
				continue
			}
			ids, amounts = append(ids, m.UUID), append(amounts, p.Amount)
			// m.Context() carries the message's effects scope: the effect belongs to
			// this message (and its tenant), and is written with the batch's others in
			// one statement.
			if _, err := effects.Enqueue(m.Context(), tx, effects.Effect{
				Kind: "email", Key: "receipt:" + m.UUID, Payload: m.Payload,
			}); err != nil {
				failed = append(failed, consumer.ForMessage(m, err))
			}
		}
		if len(failed) > 0 {
			return errors.Join(failed...) // idem runs the batch again without these
		}
		_, err := tx.Exec(ctx, `INSERT INTO ledger SELECT * FROM unnest($1::text[], $2::bigint[])`, ids, amounts)
		return err
	})

	var wg sync.WaitGroup
	for _, p := range []struct{ id, body string }{
		{"pay_1", `{"amount":10}`}, {"pay_2", `{"amount":20}`}, {"pay_2", `{"amount":20}`},
		{"pay_3", `not json`}, {"pay_4", `{"amount":40}`},
	} {
		wg.Go(func() {
			if err := handler(message.NewMessage(p.id, []byte(p.body))); err != nil {
				fmt.Println(err)
			}
		})
	}
	wg.Wait()
	var ledger, emails, failed int
	if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM ledger), (SELECT count(*) FROM effects),
		(SELECT count(*) FROM inbox WHERE state = 'failed')`).Scan(&ledger, &emails, &failed); err != nil {
		panic(err)
	}
	fmt.Println("ledger rows:", ledger, "email effects:", emails, "recorded failures:", failed)
	// Output: ledger rows: 3 email effects: 3 recorded failures: 1
}
