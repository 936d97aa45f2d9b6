// Command notification-sender is an effects worker in a process of its own: it runs
// an idem Dispatcher whose "email" sender speaks SMTP, with the effect key as the
// Message-ID. Run as many copies as you like; each effect is claimed by one at a
// time, and one that dies mid-send is retried after its lease with the same
// Message-ID.
package main

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"mime"
	"net"
	"net/mail"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/emersion/go-smtp"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/migrate"
)

// EmailKind is the effect kind this worker sends.
const EmailKind = "email"

// Email is the payload of an "email" effect.
type Email struct {
	To      string `json:"to"`
	Subject string `json:"subject"`
	Body    string `json:"body"`
}

// Config is what the worker needs.
type Config struct {
	DatabaseURL string // DATABASE_URL
	Schema      string // IDEM_SCHEMA, default "idem"
	SMTPAddr    string // SMTP_ADDR, default 127.0.0.1:1025
	From        string // MAIL_FROM
	Domain      string // MESSAGE_ID_DOMAIN: the right side of Message-IDs
	Migrate     bool   // apply idem's migrations first
	Logger      *slog.Logger
}

func main() {
	var cfg Config
	flag.StringVar(&cfg.DatabaseURL, "database-url", os.Getenv("DATABASE_URL"), "Postgres URL (env DATABASE_URL)")
	flag.StringVar(&cfg.Schema, "schema", cmp.Or(os.Getenv("IDEM_SCHEMA"), effects.DefaultSchema), "idem schema (env IDEM_SCHEMA)")
	flag.StringVar(&cfg.SMTPAddr, "smtp", cmp.Or(os.Getenv("SMTP_ADDR"), "127.0.0.1:1025"), "SMTP server host:port (env SMTP_ADDR)")
	flag.StringVar(&cfg.From, "from", cmp.Or(os.Getenv("MAIL_FROM"), "notifications@example.com"), "envelope and From address (env MAIL_FROM)")
	flag.StringVar(&cfg.Domain, "message-id-domain", cmp.Or(os.Getenv("MESSAGE_ID_DOMAIN"), "idem.example.com"), "domain of the Message-IDs (env MESSAGE_ID_DOMAIN)")
	flag.BoolVar(&cfg.Migrate, "migrate", false, "apply idem's migrations before starting")
	flag.Parse()
	cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, nil))

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, cfg)
	stop()
	if err != nil {
		cfg.Logger.Error("notification-sender", "error", err)
		os.Exit(1)
	}
}

// run starts the Dispatcher and blocks until ctx ends and it has shut down.
func run(ctx context.Context, cfg Config) error {
	if cfg.DatabaseURL == "" {
		return errors.New("set DATABASE_URL or -database-url")
	}
	pool, err := pgxpool.New(ctx, cfg.DatabaseURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	if cfg.Migrate {
		m, err := migrate.New(migrate.Config{Pool: pool, Schema: cfg.Schema})
		if err != nil {
			return err
		}
		if _, err := m.Up(ctx); err != nil {
			return err
		}
	}
	d, err := effects.NewDispatcher(effects.Config{
		Pool:    pool,
		Schema:  cfg.Schema,
		Senders: map[string]effects.Sender{EmailKind: &SMTPSender{Addr: cfg.SMTPAddr, From: cfg.From, Domain: cfg.Domain}},
		Lease:   time.Minute,
		Logger:  cfg.Logger,
	})
	if err != nil {
		return err
	}
	return d.Run(ctx)
}

// SMTPSender sends "email" effects through an SMTP server. The Message-ID is made
// from the effect's tenant and key, so every attempt at one effect carries the same Message-ID,
// and mail systems and clients that de-duplicate by it show the email once.
type SMTPSender struct {
	Addr   string
	From   string
	Domain string
}

// Send delivers one email. A 5xx reply is permanent (the effect goes dead); a
// connection lost after the message body was handed over is indefinite, since the
// server may have queued it.
func (s *SMTPSender) Send(ctx context.Context, d effects.Delivery) error {
	var e Email
	if err := json.Unmarshal(d.Payload, &e); err != nil {
		return effects.Permanent(fmt.Errorf("email payload: %w", err))
	}
	to, err := mail.ParseAddress(e.To)
	if err != nil {
		return effects.Permanent(fmt.Errorf("email recipient: %w", err))
	}
	var msg bytes.Buffer
	fmt.Fprintf(&msg, "From: %s\r\nTo: %s\r\nSubject: %s\r\nMessage-ID: %s\r\nDate: %s\r\nMIME-Version: 1.0\r\nContent-Type: text/plain; charset=utf-8\r\n\r\n%s\r\n",
		s.From, to.String(), mime.QEncoding.Encode("utf-8", e.Subject), MessageID(d.Tenant, d.Key, s.Domain), d.CreatedAt.UTC().Format(time.RFC1123Z), e.Body)

	var dialer net.Dialer
	conn, err := dialer.DialContext(ctx, "tcp", s.Addr)
	if err != nil {
		return err
	}
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(dl)
	}
	c := smtp.NewClient(conn)
	defer func() { _ = c.Close() }() // after Quit, or after a failure already returned
	if err := c.Mail(s.From, nil); err != nil {
		return classify(err)
	}
	if err := c.Rcpt(to.Address, nil); err != nil {
		return classify(err)
	}
	w, err := c.Data()
	if err != nil {
		return classify(err)
	}
	if _, err := w.Write(msg.Bytes()); err != nil {
		return classify(err)
	}
	if err := w.Close(); err != nil {
		var smtpErr *smtp.SMTPError
		if !errors.As(err, &smtpErr) {
			// The body went out; whether the server queued it is unknown.
			return effects.Indefinite(err)
		}
		return classify(err)
	}
	_ = c.Quit()
	return nil
}

func classify(err error) error {
	var smtpErr *smtp.SMTPError
	if errors.As(err, &smtpErr) && smtpErr.Code >= 500 {
		return effects.Permanent(err)
	}
	return err
}

// MessageID makes an RFC 5322 Message-ID from an effect's identity:
// "<key@domain>" for an effect without a tenant, "<tenant/key@domain>" for a
// tenant's (two tenants may each have an effect "receipt:123", and a mailbox that
// de-duplicates by Message-ID must keep both). Every byte that may not appear in a
// Message-ID is percent-encoded (":" becomes "%3A"), and so is a "/" in the
// tenant, so the tenant and the key can never run into each other.
func MessageID(tenant, key, domain string) string {
	var b strings.Builder
	b.WriteByte('<')
	if tenant != "" {
		writeAtext(&b, tenant, "/")
		b.WriteByte('/')
	}
	writeAtext(&b, key, "")
	b.WriteByte('@')
	b.WriteString(domain)
	b.WriteByte('>')
	return b.String()
}

// writeAtext writes s with every byte outside RFC 5322's atext and ".", and every
// byte of also, percent-encoded.
func writeAtext(b *strings.Builder, s, also string) {
	for i := range len(s) {
		c := s[i]
		if c < 0x80 && strings.IndexByte(also, c) < 0 && (c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte("!#$&'*+-/=?^_`{|}~.", c) >= 0) {
			b.WriteByte(c)
		} else {
			fmt.Fprintf(b, "%%%02X", c)
		}
	}
}
