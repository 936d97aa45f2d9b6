package payments

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/mail"
	"strings"
	"sync"
	"time"

	"github.com/emersion/go-smtp"

	"github.com/idemkit/idem/chaos"
	"github.com/idemkit/idem/effects"
)

// Mailbox is an in-process SMTP receiver that counts every message it accepts by
// Message-ID: the outside world of the scenario.
type Mailbox struct {
	srv  *smtp.Server
	addr string

	mu     sync.Mutex
	counts map[string]int
	total  int
}

// StartMailbox listens on addr ("127.0.0.1:0" for any free port).
func StartMailbox(addr string) (*Mailbox, error) {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	m := &Mailbox{addr: l.Addr().String(), counts: map[string]int{}}
	m.srv = smtp.NewServer(m)
	m.srv.Domain = "localhost"
	m.srv.ReadTimeout = 10 * time.Second
	m.srv.WriteTimeout = 10 * time.Second
	m.srv.ErrorLog = log.New(io.Discard, "", 0) // senders killed mid-session are expected
	go func() { _ = m.srv.Serve(l) }()
	return m, nil
}

// Addr is the host:port to send to.
func (m *Mailbox) Addr() string { return m.addr }

// Close stops the server.
func (m *Mailbox) Close() error { return m.srv.Close() }

// Counts returns, per effect (its MailKey), how many emails carried it as their
// Message-ID.
// It fits chaos.AuditQuery.Sends.
func (m *Mailbox) Counts(context.Context) (map[string]int, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make(map[string]int, len(m.counts))
	for k, n := range m.counts {
		out[k] = n
	}
	return out, nil
}

// Total is how many emails arrived.
func (m *Mailbox) Total() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.total
}

// NewSession implements smtp.Backend.
func (m *Mailbox) NewSession(*smtp.Conn) (smtp.Session, error) { return &session{box: m}, nil }

type session struct{ box *Mailbox }

func (s *session) Reset()                               {}
func (s *session) Logout() error                        { return nil }
func (s *session) Mail(string, *smtp.MailOptions) error { return nil }
func (s *session) Rcpt(string, *smtp.RcptOptions) error { return nil }
func (s *session) Data(r io.Reader) error {
	msg, err := mail.ReadMessage(r)
	if err != nil {
		return err
	}
	key := EffectKeyOf(msg.Header.Get("Message-ID"))
	s.box.mu.Lock()
	s.box.counts[key]++
	s.box.total++
	s.box.mu.Unlock()
	return nil
}

// MessageID makes "<key@domain>" from an effect key, percent-encoding every byte
// that may not appear in it.
func MessageID(key string) string {
	var b strings.Builder
	b.WriteByte('<')
	for i := range len(key) {
		c := key[i]
		if c < 0x80 && (c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte("!#$&'*+-/=?^_`{|}~.", c) >= 0) {
			b.WriteByte(c)
		} else {
			fmt.Fprintf(&b, "%%%02X", c)
		}
	}
	return b.String() + "@" + mailDomain + ">"
}

// EffectKeyOf reverses MessageID.
func EffectKeyOf(messageID string) string {
	s := strings.TrimSuffix(strings.TrimPrefix(strings.TrimSpace(messageID), "<"), "@"+mailDomain+">")
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '%' && i+2 < len(s) {
			var c byte
			if _, err := fmt.Sscanf(s[i+1:i+3], "%02X", &c); err == nil {
				b.WriteByte(c)
				i += 2
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// MailKey is the mailbox's key of an effect: its key, prefixed with its tenant and
// a zero byte when it has one, so that two tenants' effects with the same key are
// two emails. The Message-ID carries it (MessageID), and Mailbox.Counts counts by it.
func MailKey(tenant, effectKey string) string {
	if tenant == "" {
		return effectKey
	}
	return tenant + "\x00" + effectKey
}

// SMTPSender sends email effects to Addr with the effect's MailKey as Message-ID,
// so every attempt at one effect carries the same identity.
type SMTPSender struct {
	Addr string
}

// Send implements effects.Sender.
func (s *SMTPSender) Send(ctx context.Context, d effects.Delivery) error {
	var e Email
	if err := json.Unmarshal(d.Payload, &e); err != nil {
		return effects.Permanent(fmt.Errorf("email payload: %w", err))
	}
	var msg bytes.Buffer
	fmt.Fprintf(&msg, "From: shop@example.com\r\nTo: %s\r\nSubject: %s\r\nMessage-ID: %s\r\n\r\n%s\r\n", e.To, e.Subject, MessageID(MailKey(d.Tenant, d.Key)), e.Body)
	var dialer net.Dialer
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	conn, err := dialer.DialContext(ctx, "tcp", s.Addr)
	if err != nil {
		return err
	}
	dl, _ := ctx.Deadline()
	_ = conn.SetDeadline(dl)
	c := smtp.NewClient(conn)
	defer func() { _ = c.Close() }() // after Quit, or on a failure already returned
	if err := c.Mail("shop@example.com", nil); err != nil {
		return err
	}
	if err := c.Rcpt(e.To, nil); err != nil {
		return err
	}
	w, err := c.Data()
	if err != nil {
		return err
	}
	if _, err := w.Write(msg.Bytes()); err != nil {
		return err
	}
	if err := w.Close(); err != nil {
		var smtpErr *smtp.SMTPError
		if !errors.As(err, &smtpErr) {
			return effects.Indefinite(err) // the body went out; queued or not is unknown
		}
		return err
	}
	_ = c.Quit()
	// A process armed with mid-send dies here: sent, not yet marked done.
	chaos.Crash(chaos.MidSend)
	return nil
}
