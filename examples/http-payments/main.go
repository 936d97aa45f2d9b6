// Command http-payments is the whole idem story in one program. POST /payments with
// an Idempotency-Key header writes a payment row and, in the same transaction,
// enqueues a receipt email effect and a "payments.created" message (a publish
// effect); the answer is stored with the key, so a retry gets it back and never a
// second payment. A Dispatcher sends both effects: the email over SMTP, the message
// to a Watermill GoChannel, where a consumer with the idem middleware turns it into
// a ledger row, once however often it arrives.
//
//	go run ./examples/http-payments
//	curl -i -X POST localhost:8080/payments -H 'X-Account: acct_42' -H 'Idempotency-Key: 3f1c…' -d '{"amount":"12.50","currency":"EUR","email":"ann@example.com"}'
package main

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"math/big"
	"mime"
	"net"
	"net/http"
	"net/mail"
	"os"
	"os/signal"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/emersion/go-smtp"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/httpidem"
	"github.com/idemkit/idem/janitor"
	"github.com/idemkit/idem/migrate"
)

// Topic carries the payments.created messages.
const Topic = "payments.created"

// Config is what the program needs.
type Config struct {
	DatabaseURL string
	// Schema holds idem's tables and the example's (payments, ledger).
	Schema string
	// SMTPAddr is the SMTP server for receipts; empty starts a receiver in the
	// process that logs every email it gets.
	SMTPAddr string
	// OnMail, if set, is called for every email the built-in receiver gets.
	OnMail func(to, messageID string)
	Logger *slog.Logger
}

func main() {
	var cfg Config
	addr := flag.String("addr", "127.0.0.1:8080", "HTTP listen address")
	flag.StringVar(&cfg.DatabaseURL, "database-url", cmp.Or(os.Getenv("DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"), "Postgres URL (env DATABASE_URL)")
	flag.StringVar(&cfg.Schema, "schema", "idem_example_http", "schema of the idem tables, payments and ledger (migrated on start)")
	flag.StringVar(&cfg.SMTPAddr, "smtp", os.Getenv("SMTP_ADDR"), "SMTP server for receipts (env SMTP_ADDR); empty: a receiver in this process")
	flag.Parse()
	cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, nil))

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	ln, err := net.Listen("tcp", *addr)
	if err == nil {
		err = run(ctx, cfg, ln)
	}
	stop()
	if err != nil {
		cfg.Logger.Error("http-payments", "error", err)
		os.Exit(1)
	}
}

// run serves HTTP on ln, consumes and dispatches until ctx ends.
func run(ctx context.Context, cfg Config, ln net.Listener) (err error) {
	log := cfg.Logger
	pool, err := pgxpool.New(ctx, cfg.DatabaseURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := migrateSchema(ctx, pool, cfg.Schema); err != nil {
		return err
	}
	if cfg.SMTPAddr == "" {
		box, startErr := startMailbox(log, cfg.OnMail)
		if startErr != nil {
			return startErr
		}
		defer func() { err = errors.Join(err, box.Close()) }()
		cfg.SMTPAddr = box.addr
	}

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	errc := make(chan error, 4)
	goRun := func(name string, f func() error) {
		wg.Go(func() {
			if err := f(); err != nil && ctx.Err() == nil {
				errc <- fmt.Errorf("%s: %w", name, err)
			}
			cancel()
		})
	}
	defer wg.Wait()

	// The broker: a Watermill GoChannel in this process. Any Watermill publisher
	// works the same (adapters/nats, adapters/kafka).
	wlog := watermill.NewSlogLogger(log)
	bus := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, wlog)
	defer func() { err = errors.Join(err, bus.Close()) }()

	// The consumer: payments.created -> one ledger row per payment.
	ledger, err := consumer.New(consumer.Config{Name: "ledger", Pool: pool, Schema: cfg.Schema, Logger: log})
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, ledger.Close()) }()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, wlog)
	if err != nil {
		return err
	}
	router.AddConsumerHandler("ledger", Topic, bus, bookPayment(cfg.Schema)).
		AddMiddleware(ledger.Middleware)
	goRun("router", func() error { return router.Run(ctx) })
	<-router.Running() // subscribed before anything is published

	// The Dispatcher: sends the receipt emails and publishes the messages.
	senders := effects.PublishSenders(bus, Topic)
	senders["email"] = &smtpSender{addr: cfg.SMTPAddr, from: "payments@example.com"}
	d, err := effects.NewDispatcher(effects.Config{Pool: pool, Schema: cfg.Schema, Senders: senders, Logger: log})
	if err != nil {
		return err
	}
	goRun("dispatcher", func() error { return d.Run(ctx) })

	// The janitor deletes keys, stored responses and done effects after their
	// retention.
	jan, err := janitor.New(janitor.Config{Pool: pool, Schema: cfg.Schema, Logger: log})
	if err != nil {
		return err
	}
	goRun("janitor", func() error { return jan.Run(ctx) })

	// The API.
	idem, err := httpidem.New(httpidem.Config{
		Pool:   pool,
		Schema: cfg.Schema,
		// Keys are scoped to the account (New refuses a config without a scope): a
		// stand-in for your authentication's principal, which must be set before
		// this middleware runs. A request without one is 400 tenant_invalid.
		Tenant: func(r *http.Request) (string, error) { return r.Header.Get("X-Account"), nil },
		Logger: log,
	})
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	mux.Handle("POST /payments", idem.Middleware(createPayment(cfg.Schema)))
	// A read passes through the middleware untouched: nothing is stored, so it is
	// never replayed stale.
	mux.Handle("GET /payments/{id}", idem.Middleware(showPayment(pool, cfg.Schema)))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	goRun("http", func() error {
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			return err
		}
		return nil
	})
	log.Info("http-payments: listening", "addr", ln.Addr().String(), "smtp", cfg.SMTPAddr, "schema", cfg.Schema)

	<-ctx.Done()
	shutdown, stop := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer stop()
	_ = srv.Shutdown(shutdown)
	wg.Wait()
	select {
	case err := <-errc:
		return err
	default:
		return nil
	}
}

// PaymentRequest is the body of POST /payments.
type PaymentRequest struct {
	// Amount is a decimal string or number ("12.50"); it is kept exact.
	Amount   json.Number `json:"amount"`
	Currency string      `json:"currency"`
	Email    string      `json:"email"`
}

// Payment is a stored payment, as the API returns it.
type Payment struct {
	ID       string `json:"id"`
	Account  string `json:"account,omitempty"`
	Amount   string `json:"amount"`
	Currency string `json:"currency"`
	Email    string `json:"email"`
	Booked   *bool  `json:"booked,omitempty"`
}

// Email is the payload of an "email" effect.
type Email struct {
	To      string `json:"to"`
	Subject string `json:"subject"`
	Body    string `json:"body"`
}

var currencyRe = regexp.MustCompile(`^[A-Z]{3}$`)

// createPayment runs in idem's transaction: the payment, its receipt effect and
// its payments.created message commit together with the key and the answer.
func createPayment(schema string) http.HandlerFunc {
	insert := `INSERT INTO ` + pgx.Identifier{schema, "payments"}.Sanitize() + ` (id, account, amount, currency, email) VALUES ($1, $2, $3::numeric, $4, $5)`
	return func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		var in PaymentRequest
		dec := json.NewDecoder(r.Body)
		dec.UseNumber()
		if err := dec.Decode(&in); err != nil {
			problem(w, http.StatusBadRequest, "the body is not a payment: "+err.Error())
			return
		}
		amount, ok := new(big.Rat).SetString(string(in.Amount))
		switch {
		case !ok || amount.Sign() <= 0:
			problem(w, http.StatusUnprocessableEntity, "amount must be a positive decimal")
			return
		case !currencyRe.MatchString(in.Currency):
			problem(w, http.StatusUnprocessableEntity, "currency must be an ISO 4217 code such as EUR")
			return
		case !strings.Contains(in.Email, "@"):
			problem(w, http.StatusUnprocessableEntity, "email must be an email address")
			return
		}
		p := Payment{ID: "pay_" + consumer.NewUUID(), Account: r.Header.Get("X-Account"), Amount: string(in.Amount), Currency: in.Currency, Email: in.Email}
		tx := httpidem.Tx(ctx)
		if _, err := tx.Exec(ctx, insert, p.ID, p.Account, p.Amount, p.Currency, p.Email); err != nil {
			http.Error(w, "could not store the payment", http.StatusServiceUnavailable) // rolled back; a retry runs again
			return
		}
		receipt, _ := json.Marshal(Email{To: p.Email, Subject: "Your receipt " + p.ID, Body: fmt.Sprintf("We received %s %s.", p.Amount, p.Currency)})
		created, _ := json.Marshal(p)
		msg, err := effects.PublishEffect(Topic, message.NewMessage(consumer.NewUUID(), created))
		if err == nil {
			_, err = effects.Enqueue(ctx, tx, effects.Effect{Kind: "email", Key: "receipt:" + p.ID, Payload: receipt})
		}
		if err == nil {
			_, err = effects.Enqueue(ctx, tx, msg)
		}
		if err != nil {
			http.Error(w, "could not enqueue the effects", http.StatusServiceUnavailable)
			return
		}
		body, _ := json.Marshal(p)
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Cache-Control", "no-store") // stored with the answer and replayed
		w.Header().Set("Location", "/payments/"+p.ID)
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(append(body, '\n'))
	}
}

// problem answers with an RFC 9457 problem; 400 and 422 are stored and replayed.
func problem(w http.ResponseWriter, status int, detail string) {
	body, _ := json.Marshal(struct {
		Type   string `json:"type"`
		Title  string `json:"title"`
		Status int    `json:"status"`
		Detail string `json:"detail"`
	}{"about:blank", http.StatusText(status), status, detail})
	w.Header().Set("Content-Type", "application/problem+json")
	w.WriteHeader(status)
	_, _ = w.Write(append(body, '\n'))
}

// showPayment answers GET /payments/{id}, with whether the ledger booked it.
func showPayment(pool *pgxpool.Pool, schema string) http.HandlerFunc {
	query := `SELECT p.id, p.account, p.amount::text, p.currency, p.email, EXISTS (SELECT 1 FROM ` + pgx.Identifier{schema, "ledger"}.Sanitize() + ` l WHERE l.payment_id = p.id)
		FROM ` + pgx.Identifier{schema, "payments"}.Sanitize() + ` p WHERE p.id = $1`
	return func(w http.ResponseWriter, r *http.Request) {
		var p Payment
		var booked bool
		err := pool.QueryRow(r.Context(), query, r.PathValue("id")).Scan(&p.ID, &p.Account, &p.Amount, &p.Currency, &p.Email, &booked)
		if errors.Is(err, pgx.ErrNoRows) {
			http.NotFound(w, r)
			return
		}
		if err != nil {
			http.Error(w, "database unavailable", http.StatusServiceUnavailable)
			return
		}
		p.Booked = &booked
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(p)
	}
}

// bookPayment runs in the consumer's transaction: one ledger row per
// payments.created message, however often it is delivered.
func bookPayment(schema string) message.NoPublishHandlerFunc {
	insert := `INSERT INTO ` + pgx.Identifier{schema, "ledger"}.Sanitize() + ` (payment_id, account, amount, currency) VALUES ($1, $2, $3::numeric, $4)`
	return func(msg *message.Message) error {
		ctx := msg.Context()
		var p Payment
		if err := json.Unmarshal(msg.Payload, &p); err != nil || p.ID == "" {
			return consumer.Permanent(fmt.Errorf("not a payment: %v", cmp.Or(err, errors.New("no id"))))
		}
		_, err := consumer.Tx(ctx).Exec(ctx, insert, p.ID, p.Account, p.Amount, p.Currency)
		return err
	}
}

func migrateSchema(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: schema})
	if err != nil {
		return err
	}
	if _, err := m.Up(ctx); err != nil {
		return err
	}
	// ledger has no unique constraint on purpose: only the inbox keeps a
	// redelivered message from booking twice.
	_, err = pool.Exec(ctx, `
		CREATE TABLE IF NOT EXISTS `+pgx.Identifier{schema, "payments"}.Sanitize()+` (
			id text PRIMARY KEY, account text NOT NULL, amount numeric NOT NULL, currency text NOT NULL,
			email text NOT NULL, created_at timestamptz NOT NULL DEFAULT now());
		CREATE TABLE IF NOT EXISTS `+pgx.Identifier{schema, "ledger"}.Sanitize()+` (
			id bigserial PRIMARY KEY, payment_id text NOT NULL, account text NOT NULL, amount numeric NOT NULL,
			currency text NOT NULL, booked_at timestamptz NOT NULL DEFAULT now())`)
	return err
}

// smtpSender sends "email" effects; the Message-ID is the effect key, so every
// attempt at one receipt is the same email (examples/notification-sender has the
// full sender, with failure classes).
type smtpSender struct{ addr, from string }

func (s *smtpSender) Send(ctx context.Context, d effects.Delivery) error {
	var e Email
	if err := json.Unmarshal(d.Payload, &e); err != nil {
		return effects.Permanent(err)
	}
	var msg bytes.Buffer
	fmt.Fprintf(&msg, "From: %s\r\nTo: %s\r\nSubject: %s\r\nMessage-ID: <%s@payments.example.com>\r\nMIME-Version: 1.0\r\nContent-Type: text/plain; charset=utf-8\r\n\r\n%s\r\n",
		s.from, e.To, mime.QEncoding.Encode("utf-8", e.Subject), strings.ReplaceAll(d.Key, ":", "."), e.Body)
	var dialer net.Dialer
	conn, err := dialer.DialContext(ctx, "tcp", s.addr)
	if err != nil {
		return err
	}
	c := smtp.NewClient(conn)
	defer func() { _ = c.Close() }() // SendMail's error is the one that matters
	return c.SendMail(s.from, []string{e.To}, &msg)
}

// mailbox is a stand-in SMTP server that logs what it receives.
type mailbox struct {
	srv    *smtp.Server
	addr   string
	log    *slog.Logger
	onMail func(to, messageID string)
}

func startMailbox(log *slog.Logger, onMail func(to, messageID string)) (*mailbox, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	m := &mailbox{addr: l.Addr().String(), log: log, onMail: onMail}
	m.srv = smtp.NewServer(m)
	m.srv.Domain = "localhost"
	m.srv.ErrorLog = logDiscard
	go func() { _ = m.srv.Serve(l) }()
	return m, nil
}

var logDiscard = log.New(io.Discard, "", 0)

func (m *mailbox) Close() error { return m.srv.Close() }

func (m *mailbox) NewSession(*smtp.Conn) (smtp.Session, error) { return &session{box: m}, nil }

type session struct {
	box *mailbox
	to  string
}

func (s *session) Reset()                               {}
func (s *session) Logout() error                        { return nil }
func (s *session) Mail(string, *smtp.MailOptions) error { return nil }
func (s *session) Rcpt(to string, _ *smtp.RcptOptions) error {
	s.to = to
	return nil
}

func (s *session) Data(r io.Reader) error {
	msg, err := mail.ReadMessage(r)
	if err != nil {
		return err
	}
	id := msg.Header.Get("Message-ID")
	s.box.log.Info("smtp: email received", "to", s.to, "subject", msg.Header.Get("Subject"), "message_id", id)
	if s.box.onMail != nil {
		s.box.onMail(s.to, id)
	}
	return nil
}
