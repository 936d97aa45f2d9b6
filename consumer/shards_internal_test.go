package consumer

import (
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/shard"
)

// Each shard's Consumer of a map computes the default fingerprint as a Consumer
// on one database does (into the request, no allocation), and calls a
// Fingerprint that the config sets.
func TestShardConsumersKeepTheDefaultFingerprint(t *testing.T) {
	t.Parallel()
	m := &shard.Map{Shards: []shard.Shard{{Name: "s1", Pool: &pgxpool.Pool{}}, {Name: "s2", Pool: &pgxpool.Pool{}}}}
	for _, custom := range []bool{false, true} {
		cfg := Config{Shards: m, Tenant: MetadataKey("tenant"), SkipSchemaCheck: true} // pools of no database
		if custom {
			cfg.Fingerprint = inbox.SHA256
		}
		c, err := New(cfg)
		require.NoError(t, err)
		require.Equal(t, 2, c.parts.Len())
		for _, one := range c.parts.Parts() {
			require.Equal(t, !custom, one.defaultFP, "custom Fingerprint %v", custom)
		}
		require.NoError(t, c.Close())
	}
}
