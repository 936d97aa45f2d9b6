package inbox_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/canonjson"
	"github.com/idemkit/idem/internal/inboxdb"
)

// TestSentinelsAreTheEnginesValues: what the engine in internal/inboxdb (and
// internal/canonjson) returns is the value inbox exports, so a user's errors.Is
// against inbox's sentinels holds for errors the consumer and httpidem return.
func TestSentinelsAreTheEnginesValues(t *testing.T) {
	t.Parallel()
	require.ErrorIs(t, inboxdb.ValidateKey(""), inbox.ErrEmptyKey)
	require.ErrorIs(t, inboxdb.ValidateTenant("bad\x00"), inbox.ErrTenantInvalid)
	require.ErrorIs(t, inboxdb.ValidateConsumer(""), inbox.ErrConsumerInvalid)
	_, err := canonjson.Canonicalize([]byte(`{`), canonjson.Options{})
	require.ErrorIs(t, err, inbox.ErrNotJSON)
	require.Equal(t, "tenant_invalid", inbox.Code(inbox.ID{Consumer: "c", Tenant: "bad\x00", Key: "k"}.Validate()))
	require.ErrorIs(t, inbox.ID{Key: "k"}.Validate(), inbox.ErrConsumerInvalid)
	require.NoError(t, inbox.ID{Consumer: "c", Key: "k"}.Validate())
	require.Equal(t, string(inboxdb.StateFailed), string(inbox.StateFailed))
}
