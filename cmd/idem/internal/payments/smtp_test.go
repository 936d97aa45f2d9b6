package payments

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/effects"
)

// The mailbox counts an effect by its tenant and key: two tenants' effects with
// the same key are two emails, and an untenanted effect keeps its plain key.
func TestSMTPSenderKeysEmailsByTenant(t *testing.T) {
	box, err := StartMailbox("127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = box.Close() })
	s := &SMTPSender{Addr: box.Addr()}
	payload := []byte(`{"to":"customer@example.com","subject":"s","body":"b"}`)
	for _, tenant := range []string{"", "acme", "acme", "globex <x@y>"} {
		require.NoError(t, s.Send(context.Background(), effects.Delivery{Kind: EmailKind, Tenant: tenant, Key: "receipt:1", Payload: payload}))
	}
	counts, err := box.Counts(context.Background())
	require.NoError(t, err)
	require.Equal(t, map[string]int{"receipt:1": 1, "acme\x00receipt:1": 2, "globex <x@y>\x00receipt:1": 1}, counts)
	require.Equal(t, "receipt:1", MailKey("", "receipt:1"))
	for _, k := range []string{"receipt:1", MailKey("acme", "receipt:1"), MailKey("a b/%", "k\x01")} {
		require.Equal(t, k, EffectKeyOf(MessageID(k)))
	}
}
