// Package payments is the scenario shared by `idem demo`, the end-to-end SIGKILL
// suite and its peer comparison: each payment message makes one ledger row (the
// business write) and one receipt email (an effect), which a Dispatcher sends
// through SMTP to a receiver that counts every Message-ID it gets.
//
// The ledger has no unique constraint on the payment on purpose: a payment
// committed twice shows up as two rows, so the audit can see it. Each row carries
// its payment's tenant (TenantMetadata; "" without one), and its key includes it,
// so that on Citus the ledger can be distributed by tenant, colocated with idem's
// inbox.
package payments

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/chaos"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/redact"
)

// Topic is the topic (Kafka) or subject (NATS) payments are published on, and
// Consumer the idem consumer name that handles them.
const (
	Topic      = "payments"
	Consumer   = "payments"
	EmailKind  = "email"
	mailDomain = "idem.demo"
)

// Payment is a payment message's payload.
type Payment struct {
	ID     string `json:"id"`
	Amount int64  `json:"amount"`
}

// Email is an email effect's payload.
type Email struct {
	To      string `json:"to"`
	Subject string `json:"subject"`
	Body    string `json:"body"`
}

// EmailKey is the effect key of a payment's receipt, and the Message-ID's local part.
func EmailKey(paymentKey string) string { return "receipt:" + paymentKey }

// TenantMetadata is the metadata field that carries a payment's tenant, which
// picks its shard when the consumer runs on a shard map.
const TenantMetadata = "tenant"

// NewMessage makes a payment message with a fresh UUIDv7 (the idempotency key).
func NewMessage(amount int64) *message.Message {
	id := consumer.NewUUID()
	payload, _ := json.Marshal(Payment{ID: id, Amount: amount})
	return message.NewMessage(id, payload)
}

// NewTenantMessage is NewMessage for a tenant (TenantMetadata).
func NewTenantMessage(amount int64, tenant string) *message.Message {
	m := NewMessage(amount)
	m.Metadata.Set(TenantMetadata, tenant)
	return m
}

// CreateTables creates the ledger table in schema (the idem tables must be
// migrated separately). On Citus, distribute it by tenant, colocated with the
// inbox, once it is created.
func CreateTables(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	_, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+pgx.Identifier{schema, "ledger"}.Sanitize()+` (
		tenant text NOT NULL DEFAULT '', id bigserial, payment_key text NOT NULL, amount bigint NOT NULL,
		created_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (tenant, id))`)
	return err
}

// LedgerCountsSQL returns (payment key, rows) for the auditor.
func LedgerCountsSQL(schema string) string {
	return `SELECT payment_key, count(*) FROM ` + pgx.Identifier{schema, "ledger"}.Sanitize() + ` GROUP BY 1`
}

// LedgerRowsSQL counts ledger rows.
func LedgerRowsSQL(schema string) string {
	return `SELECT count(*) FROM ` + pgx.Identifier{schema, "ledger"}.Sanitize()
}

func decode(msg *message.Message) (Payment, error) {
	var p Payment
	if err := json.Unmarshal(msg.Payload, &p); err != nil {
		return p, err
	}
	if p.ID == "" {
		return p, errors.New("payment without id")
	}
	return p, nil
}

func receipt(p Payment) []byte {
	b, _ := json.Marshal(Email{To: "customer@example.com", Subject: "Your receipt",
		Body: "We received your payment " + p.ID + " of " + strconv.FormatInt(p.Amount, 10) + " cents."})
	return b
}

// Handler is the idem handler: the ledger row, under the payment's tenant
// (TenantMetadata), and the email effect, both in the transaction idem opened for
// the message. chaos.Crash(chaos.BeforeCommit) is the
// last statement, so a process armed with it can die with the work uncommitted.
func Handler(schema string) message.HandlerFunc {
	insert := `INSERT INTO ` + pgx.Identifier{schema, "ledger"}.Sanitize() + ` (tenant, payment_key, amount) VALUES ($1, $2, $3)`
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		p, err := decode(msg)
		if err != nil {
			return nil, consumer.Permanent(err)
		}
		tx := consumer.Tx(ctx)
		if _, err := tx.Exec(ctx, insert, msg.Metadata.Get(TenantMetadata), msg.UUID, p.Amount); err != nil {
			return nil, err
		}
		if _, err := effects.Enqueue(ctx, tx, effects.Effect{Kind: EmailKind, Key: EmailKey(msg.UUID), Payload: receipt(p)}); err != nil {
			return nil, err
		}
		chaos.Crash(chaos.BeforeCommit)
		return nil, nil
	}
}

// BatchHandler is Handler for a whole batch (consumer.HandleBatch): one INSERT …
// SELECT FROM unnest writes the ledger rows of every message, and each message's
// receipt goes to the batch's one effects statement. A payment that does not decode
// fails alone, permanently. chaos.Crash(chaos.BeforeCommit) is the last statement,
// so a process armed with it dies with the batch's keys claimed and nothing of it
// committed.
func BatchHandler(schema string) consumer.BatchHandler {
	insert := `INSERT INTO ` + pgx.Identifier{schema, "ledger"}.Sanitize() +
		` (tenant, payment_key, amount) SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[])`
	return func(ctx context.Context, tx pgx.Tx, msgs []*message.Message) error {
		tenants := make([]string, 0, len(msgs))
		keys := make([]string, 0, len(msgs))
		amounts := make([]int64, 0, len(msgs))
		var failed []error
		for _, m := range msgs {
			p, err := decode(m)
			if err != nil {
				failed = append(failed, consumer.ForMessage(m, consumer.Permanent(err)))
				continue
			}
			if ran, ok := m.Context().Value(ranKey{}).(*bool); ok {
				*ran = true
			}
			tenants, keys, amounts = append(tenants, m.Metadata.Get(TenantMetadata)), append(keys, m.UUID), append(amounts, p.Amount)
			if _, err := effects.Enqueue(m.Context(), tx, effects.Effect{Kind: EmailKind, Key: EmailKey(m.UUID), Payload: receipt(p)}); err != nil {
				failed = append(failed, consumer.ForMessage(m, err))
			}
		}
		if len(failed) > 0 {
			return errors.Join(failed...)
		}
		if _, err := tx.Exec(ctx, insert, tenants, keys, amounts); err != nil {
			return err
		}
		chaos.Crash(chaos.BeforeCommit)
		return nil
	}
}

// PeerHandler is the same work without idem, for a peer such as Watermill's
// Deduplicator: the ledger row in a transaction of its own, then the email sent
// straight away (there are no effect rows to send later).
func PeerHandler(pool *pgxpool.Pool, schema string, sender effects.Sender) message.HandlerFunc {
	insert := `INSERT INTO ` + pgx.Identifier{schema, "ledger"}.Sanitize() + ` (tenant, payment_key, amount) VALUES ($1, $2, $3)`
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		p, err := decode(msg)
		if err != nil {
			return nil, err
		}
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, insert, msg.Metadata.Get(TenantMetadata), msg.UUID, p.Amount)
			if err == nil {
				chaos.Crash(chaos.BeforeCommit)
			}
			return err
		}); err != nil {
			return nil, err
		}
		return nil, sender.Send(ctx, effects.Delivery{Kind: EmailKind, Key: EmailKey(msg.UUID), Payload: receipt(p)})
	}
}

// AuditQuery is the audit of a run that published keys. sends counts the emails
// the receiver got, by effect key. peer is true for a run without idem (no inbox
// rows and no effect rows to match).
func AuditQuery(schema string, keys []string, sends func(context.Context) (map[string]int, error), peer bool) chaos.AuditQuery {
	q := chaos.AuditQuery{
		Consumer: Consumer, ExpectedKeys: keys, BusinessSQL: LedgerCountsSQL(schema),
		SendKey: EmailKey, Sends: sends, Deliveries: -1, DuplicatesSuppressed: -1,
		WithoutInbox: peer,
	}
	if !peer {
		q.EffectKind, q.EffectKey = EmailKind, EmailKey
	}
	return q
}

// ApplicationName tags every connection of a run, so that backend cuts
// (pg_terminate_backend) hit this run's connections only.
func ApplicationName(schema string) string { return "idem-run:" + schema }

// TerminateBackends cuts every connection tagged with ApplicationName(schema),
// except the caller's own, and returns how many it cut.
func TerminateBackends(ctx context.Context, pool *pgxpool.Pool, schema string) (int, error) {
	var n int
	err := pool.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
		WHERE application_name = $1 AND pid <> pg_backend_pid()`, ApplicationName(schema)).Scan(&n)
	return n, err
}

// NewPool opens a small pool whose connections carry appName (ApplicationName
// for a run's workers; anything else for the pool that cuts them). Its errors
// never show the database password.
func NewPool(ctx context.Context, url, appName string, maxConns int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, redact.Error(fmt.Errorf("parse database URL: %w", err), url)
	}
	cfg.MaxConns = maxConns
	cfg.ConnConfig.RuntimeParams["application_name"] = appName
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	return pool, redact.Error(err, url)
}
