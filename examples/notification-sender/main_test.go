package main

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/mail"
	"sync"
	"testing"
	"time"

	"github.com/emersion/go-smtp"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/internal/pgtest"
)

// mailbox is an in-process SMTP server's backend that keeps every message.
type mailbox struct {
	mu   sync.Mutex
	msgs []*mail.Message
}

func (m *mailbox) NewSession(*smtp.Conn) (smtp.Session, error) { return &session{box: m}, nil }

func (m *mailbox) byMessageID() map[string]int {
	m.mu.Lock()
	defer m.mu.Unlock()
	ids := map[string]int{}
	for _, msg := range m.msgs {
		ids[msg.Header.Get("Message-ID")]++
	}
	return ids
}

type session struct{ box *mailbox }

func (s *session) Reset()        {}
func (s *session) Logout() error { return nil }
func (s *session) Mail(string, *smtp.MailOptions) error {
	return nil
}
func (s *session) Rcpt(to string, _ *smtp.RcptOptions) error {
	if to == "nobody@example.com" {
		return &smtp.SMTPError{Code: 550, EnhancedCode: smtp.EnhancedCode{5, 1, 1}, Message: "no such user"}
	}
	return nil
}
func (s *session) Data(r io.Reader) error {
	msg, err := mail.ReadMessage(r)
	if err != nil {
		return err
	}
	s.box.mu.Lock()
	s.box.msgs = append(s.box.msgs, msg)
	s.box.mu.Unlock()
	return nil
}

func startSMTP(t *testing.T) (*mailbox, string) {
	box := &mailbox{}
	srv := smtp.NewServer(box)
	srv.Domain = "localhost"
	srv.AllowInsecureAuth = true
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { _ = srv.Close() })
	return box, l.Addr().String()
}

// TestNotificationSender runs the worker against real Postgres and an in-process
// SMTP server: each email arrives once, with the effect key as its Message-ID, and
// a rejected recipient makes the effect dead.
func TestNotificationSender(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 2})
	box, addr := startSMTP(t)

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, Config{DatabaseURL: pgtest.URL(), Schema: schema, SMTPAddr: addr,
			From: "shop@example.com", Domain: "shop.example.com", Logger: slog.New(slog.DiscardHandler)})
	}()

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	for key, to := range map[string]string{"receipt:pay_1": "a@example.com", "receipt:pay_2": "b@example.com", "receipt:pay_3": "nobody@example.com"} {
		payload, _ := json.Marshal(Email{To: to, Subject: "Your receipt – ✓", Body: "Thanks for paying."})
		_, err := effects.Enqueue(effects.WithScope(ctx, effects.Scope{Schema: schema}), tx, effects.Effect{Kind: EmailKind, Key: key, Payload: payload})
		require.NoError(t, err)
	}
	require.NoError(t, tx.Commit(ctx))

	pgtest.WaitFor(t, 20*time.Second, "every effect settled", func() bool {
		return pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE state IN ('done', 'dead')`) == 3
	})
	require.Equal(t, map[string]int{"<receipt%3Apay_1@shop.example.com>": 1, "<receipt%3Apay_2@shop.example.com>": 1}, box.byMessageID())
	var lastErr string
	require.NoError(t, pool.QueryRow(ctx, `SELECT last_error FROM effects WHERE key = 'receipt:pay_3' AND state = 'dead'`).Scan(&lastErr))
	require.Contains(t, lastErr, "no such user")

	cancel()
	require.NoError(t, <-done)
}

func TestMessageID(t *testing.T) {
	t.Parallel()
	require.Equal(t, "<receipt%3Apay_789@x.example>", MessageID("", "receipt:pay_789", "x.example"))
	require.Equal(t, "<a.b-c_d@x>", MessageID("", "a.b-c_d", "x"))
	require.Equal(t, "<%3Cevil%3E%20%C3%A9@x>", MessageID("", "<evil> é", "x"))
	// Two tenants' "receipt:1" are two Message-IDs, and a "/" in a tenant cannot
	// make one tenant's ID collide with another's.
	require.Equal(t, "<acme/receipt%3A1@x>", MessageID("acme", "receipt:1", "x"))
	require.NotEqual(t, MessageID("acme", "receipt:1", "x"), MessageID("globex", "receipt:1", "x"))
	require.NotEqual(t, MessageID("a/b", "c", "x"), MessageID("a", "b/c", "x"))
}
