package fanout_test

import (
	"errors"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/fanout"
	"github.com/idemkit/idem/shard"
)

type cfg struct{ db string }

func build(c cfg) (string, error) {
	if c.db == "bad" {
		return "", errors.New("refused")
	}
	return "part:" + c.db, nil
}

func TestOneDatabase(t *testing.T) {
	t.Parallel()
	s, err := fanout.Build(nil, cfg{db: "one"}, func(shard.Shard) cfg { panic("no shards") }, build)
	require.NoError(t, err)
	require.Equal(t, 1, s.Len())
	require.Equal(t, []string{""}, s.Names())
	i, err := s.Route(func() (string, error) { panic("one database never asks the tenant") })
	require.NoError(t, err)
	require.Equal(t, "part:one", s.Part(i))
	boom := errors.New("boom")
	require.Same(t, boom, s.Each(func(int, string) error { return boom }), "one database's error comes back as it is")
	require.Same(t, boom, s.Parallel(func(int, string) error { return boom }))
	require.Equal(t, 0, s.IndexOf(""))
	require.Equal(t, -1, s.IndexOf("s1"))
}

func TestShardMap(t *testing.T) {
	t.Parallel()
	m := &shard.Map{Shards: []shard.Shard{{Name: "s1"}, {Name: "s2"}, {Name: "s3"}}, Table: map[string]string{"acme": "s2"}}
	s, err := fanout.Build(m, cfg{}, func(sh shard.Shard) cfg { return cfg{db: sh.Name} }, build)
	require.NoError(t, err)
	require.Equal(t, []string{"s1", "s2", "s3"}, s.Names())
	require.Equal(t, []string{"part:s1", "part:s2", "part:s3"}, s.Parts())
	i, err := s.Route(func() (string, error) { return "acme", nil })
	require.NoError(t, err)
	require.Equal(t, "part:s2", s.Part(i))
	_, err = s.Route(func() (string, error) { return "", errors.New("no tenant") })
	require.EqualError(t, err, "no tenant")
	require.Equal(t, 2, s.IndexOf("s3"))

	var calls atomic.Int32
	err = s.Parallel(func(i int, p string) error {
		calls.Add(1)
		if i == 1 {
			return fmt.Errorf("down")
		}
		return nil
	})
	require.EqualValues(t, 3, calls.Load(), "a failing shard does not stop the others")
	require.EqualError(t, err, `shard "s2": down`)
	err = s.Each(func(i int, p string) error { return fmt.Errorf("e%d", i) })
	require.EqualError(t, err, "shard \"s1\": e0\nshard \"s2\": e1\nshard \"s3\": e2")

	out, errs := fanout.Collect(s, func(i int, p string) (int, error) { return i * 10, nil })
	require.Equal(t, []int{0, 10, 20}, out)
	require.Equal(t, []error{nil, nil, nil}, errs)

	_, err = fanout.Build(&shard.Map{Shards: []shard.Shard{{Name: "ok"}, {Name: "bad"}}}, cfg{},
		func(sh shard.Shard) cfg { return cfg{db: sh.Name} }, build)
	require.EqualError(t, err, `shard "bad": refused`)
}

// Front gives one database's part handler itself, and routes over a shard map.
func TestFront(t *testing.T) {
	t.Parallel()
	part := func(p string) func() string { return func() string { return p } }
	one, err := fanout.Build(nil, cfg{db: "one"}, func(shard.Shard) cfg { panic("no shards") }, build)
	require.NoError(t, err)
	h := fanout.Front(one, part, func([]func() string) func() string { panic("one database never routes") })
	require.Equal(t, "part:one", h())

	m := &shard.Map{Shards: []shard.Shard{{Name: "s1"}, {Name: "s2"}}}
	two, err := fanout.Build(m, cfg{}, func(sh shard.Shard) cfg { return cfg{db: sh.Name} }, build)
	require.NoError(t, err)
	h = fanout.Front(two, part, func(hs []func() string) func() string {
		require.Len(t, hs, 2)
		return func() string { return hs[1]() + " routed" }
	})
	require.Equal(t, "part:s2 routed", h())
}

// Schema defaults one database's schema and leaves a shard map's unset.
func TestSchema(t *testing.T) {
	t.Parallel()
	require.Equal(t, "idem", fanout.Schema(nil, "", "idem"))
	require.Equal(t, "mine", fanout.Schema(nil, "mine", "idem"))
	m := &shard.Map{Shards: []shard.Shard{{Name: "s1"}}}
	require.Empty(t, fanout.Schema(m, "", "idem"))
	require.Equal(t, "mine", fanout.Schema(m, "mine", "idem"), "kept, for ValidateDB to refuse")
}
