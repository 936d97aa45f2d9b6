package migrate_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/migrate"
)

// Migration 002 scopes effects by tenant. Applied to a schema at 001 (as a plain SQL
// tool would apply it), it keeps every effect, gives effects that a tenant-scoped
// consumer made their tenant, and keys effects by (tenant, kind, key). Its down
// migration refuses, changing nothing, when going back would merge or lose effects.
func TestMigration002EffectsTenant(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.Setup(t, pgtest.Options{NoMigrate: true})
	ms := migrate.Migrations()
	require.GreaterOrEqual(t, len(ms), 2)
	require.Equal(t, "effects_tenant", ms[1].Name)
	exec := func(sql string) error { _, err := pool.Exec(ctx, sql); return err }

	require.NoError(t, exec(ms[0].Up))
	require.NoError(t, exec(`INSERT INTO effects (kind, key, fingerprint, source_consumer, source_tenant, source_key) VALUES
		('email', 'receipt:1', '\x00', 'payments', 'acme', 'pay_1'),
		('email', 'receipt:2', '\x00', 'payments', '', 'pay_2'),
		('email', 'receipt:3', '\x00', NULL, NULL, NULL)`))
	require.NoError(t, exec(ms[1].Up))

	require.Equal(t, 3, pgtest.Count(t, pool, `SELECT count(*) FROM effects`))
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE tenant = 'acme' AND key = 'receipt:1'`))
	require.Equal(t, 2, pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE tenant = ''`))
	var pk string
	require.NoError(t, pool.QueryRow(ctx, `SELECT pg_get_constraintdef(oid) FROM pg_constraint
		WHERE conrelid = 'effects'::regclass AND contype = 'p'`).Scan(&pk))
	require.Equal(t, "PRIMARY KEY (tenant, kind, key)", pk)

	// Another tenant's receipt:1 is another effect.
	require.NoError(t, exec(`INSERT INTO effects (tenant, kind, key, fingerprint) VALUES ('globex', 'email', 'receipt:1', '\x00')`))
	err := exec(ms[1].Down)
	require.ErrorContains(t, err, "several tenants have effects with the same kind and key")
	require.Equal(t, 4, pgtest.Count(t, pool, `SELECT count(*) FROM effects`), "a refused down changes nothing")

	// A tenant that source_tenant does not hold would be lost.
	require.NoError(t, exec(`UPDATE effects SET key = 'receipt:g' WHERE tenant = 'globex'`))
	require.ErrorContains(t, exec(ms[1].Down), "would be lost")

	require.NoError(t, exec(`DELETE FROM effects WHERE tenant = 'globex'`))
	require.NoError(t, exec(ms[1].Down))
	require.Equal(t, 3, pgtest.Count(t, pool, `SELECT count(*) FROM effects`))
	require.NoError(t, pool.QueryRow(ctx, `SELECT pg_get_constraintdef(oid) FROM pg_constraint
		WHERE conrelid = 'effects'::regclass AND contype = 'p'`).Scan(&pk))
	require.Equal(t, "PRIMARY KEY (kind, key)", pk)
}

// allVersions is 1..n for the embedded migrations.
func allVersions() []int {
	var vs []int
	for _, m := range migrate.Migrations() {
		vs = append(vs, m.Version)
	}
	return vs
}
