package payments

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/effects"
)

// The scenario's mailbox counts by effect key alone, so a tenant's effect is
// refused for good rather than sent under a Message-ID without its tenant.
func TestSMTPSenderRefusesATenantsEffect(t *testing.T) {
	s := &SMTPSender{Addr: "127.0.0.1:1"} // never dialled
	err := s.Send(context.Background(), effects.Delivery{Kind: EmailKind, Tenant: "acme", Key: "receipt:1", Payload: []byte(`{}`)})
	require.True(t, effects.IsPermanent(err), "%v", err)
	require.ErrorContains(t, err, `tenant "acme"`)
	require.Equal(t, "receipt:1", EffectKeyOf(MessageID("receipt:1")))
}
