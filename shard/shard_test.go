package shard_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/shard"
)

// lazyPool is a pool that never connects (pgxpool connects on first use).
func lazyPool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	p, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none?sslmode=disable")
	require.NoError(t, err)
	t.Cleanup(p.Close)
	return p
}

func shards(t *testing.T, names ...string) []shard.Shard {
	out := make([]shard.Shard, len(names))
	for i, n := range names {
		out[i] = shard.Shard{Name: n, Pool: lazyPool(t)}
	}
	return out
}

func tenants(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("tenant-%d", i)
	}
	return out
}

func route(t *testing.T, m *shard.Map, tenant string) string {
	t.Helper()
	s, err := m.Pick(tenant)
	require.NoError(t, err)
	return s.Name
}

// The hash route decides where rows live, so it must never change: these values
// are the contract.
func TestScoreIsFixed(t *testing.T) {
	t.Parallel()
	require.Equal(t, uint64(0xd0137a57d0ef408f), shard.Score("a", ""))
	got := map[string]string{}
	m := &shard.Map{Shards: shards(t, "s1", "s2", "s3")}
	require.NoError(t, m.Validate())
	for _, tn := range []string{"", "acme", "globex", "initech", "umbrella", "tenant-42"} {
		got[tn] = route(t, m, tn)
	}
	require.Equal(t, map[string]string{"": "s3", "acme": "s3", "globex": "s3", "initech": "s1", "umbrella": "s1", "tenant-42": "s2"}, got)
}

func TestRendezvousStableAndBalanced(t *testing.T) {
	t.Parallel()
	a := &shard.Map{Shards: shards(t, "s1", "s2", "s3")}
	rev := slices.Clone(a.Shards)
	slices.Reverse(rev)
	b := &shard.Map{Shards: rev}
	count := map[string]int{}
	const n = 30000
	for _, tn := range tenants(n) {
		x := route(t, a, tn)
		require.Equal(t, x, route(t, b, tn), "reordering the shards moves no tenant")
		count[x]++
	}
	for name, c := range count {
		require.InDelta(t, n/3, c, n/3*0.05, "shard %s gets its share", name)
	}
}

func TestAddingAShardMovesOnlyItsShare(t *testing.T) {
	t.Parallel()
	three := shards(t, "s1", "s2", "s3")
	before := &shard.Map{Shards: three}
	after := &shard.Map{Shards: append(slices.Clone(three), shards(t, "s4")...)}
	const n = 40000
	moved := 0
	for _, tn := range tenants(n) {
		x, y := route(t, before, tn), route(t, after, tn)
		if x != y {
			require.Equal(t, "s4", y, "a tenant that moves, moves to the new shard")
			moved++
		}
	}
	require.InDelta(t, n/4, moved, n/4*0.05, "about a quarter of the tenants move")

	// Removing a shard moves only the tenants it had.
	for _, tn := range tenants(n) {
		x, y := route(t, after, tn), route(t, before, tn)
		if x != "s4" {
			require.Equal(t, x, y)
		}
	}
}

func TestTableAndRouteOverride(t *testing.T) {
	t.Parallel()
	m := &shard.Map{Shards: shards(t, "s1", "s2", "s3"), Table: map[string]string{"acme": "s1"}}
	require.NoError(t, m.Validate())
	require.Equal(t, "s1", route(t, m, "acme"))
	require.Equal(t, "s2", route(t, m, "tenant-42"), "the hash for the others")

	m.Route = func(tenant string) (string, error) {
		if tenant == "bad" {
			return "", errors.New("directory down")
		}
		if tenant == "lost" {
			return "s9", nil
		}
		return "s3", nil
	}
	require.Equal(t, "s1", route(t, m, "acme"), "the table wins over Route")
	require.Equal(t, "s3", route(t, m, "globex"))
	i, err := m.Index("bad")
	require.Equal(t, -1, i)
	require.ErrorIs(t, err, shard.ErrRoute)
	require.ErrorContains(t, err, "directory down")
	require.Equal(t, "shard_route", errcode.Code(err))
	require.True(t, errcode.IsPermanent(err))
	_, err = m.Pick("lost")
	require.ErrorIs(t, err, shard.ErrRoute)
	require.ErrorContains(t, err, `"s9"`)
	require.Equal(t, []string{"s1", "s2", "s3"}, m.Names())
}

func TestValidate(t *testing.T) {
	t.Parallel()
	p := lazyPool(t)
	for name, tc := range map[string]struct {
		m    *shard.Map
		want string
		is   error
	}{
		"nil":         {nil, "no shards", errcode.ErrInvalidConfig},
		"empty":       {&shard.Map{}, "no shards", errcode.ErrInvalidConfig},
		"no name":     {&shard.Map{Shards: []shard.Shard{{Pool: p}}}, "shard 0 has no Name", errcode.ErrInvalidConfig},
		"bad name":    {&shard.Map{Shards: []shard.Shard{{Name: "a\nb", Pool: p}}}, "printable", errcode.ErrInvalidConfig},
		"dup name":    {&shard.Map{Shards: []shard.Shard{{Name: "a", Pool: p}, {Name: "a", Pool: p, Schema: "x"}}}, "appears twice", errcode.ErrInvalidConfig},
		"no pool":     {&shard.Map{Shards: []shard.Shard{{Name: "a"}}}, "no Pool", errcode.ErrInvalidConfig},
		"bad schema":  {&shard.Map{Shards: []shard.Shard{{Name: "a", Pool: p, Schema: "X-1"}}}, "X-1", pgschema.ErrInvalid},
		"same place":  {&shard.Map{Shards: []shard.Shard{{Name: "a", Pool: p}, {Name: "b", Pool: p, Schema: "idem"}}}, "share a pool and schema", errcode.ErrInvalidConfig},
		"table wrong": {&shard.Map{Shards: []shard.Shard{{Name: "a", Pool: p}}, Table: map[string]string{"t": "b"}}, `"b"`, errcode.ErrInvalidConfig},
	} {
		err := tc.m.Validate()
		require.ErrorIs(t, err, tc.is, name)
		require.ErrorContains(t, err, tc.want, name)
	}
	ok := &shard.Map{Shards: []shard.Shard{{Name: "a", Pool: p}, {Name: "b", Pool: p, Schema: "other"}}}
	require.NoError(t, ok.Validate(), "two schemas of one database are two shards")
	require.Equal(t, "idem", ok.Shards[0].SchemaName())
}
