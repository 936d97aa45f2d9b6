package fanout_test

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/fanout"
	"github.com/idemkit/idem/shard"
)

var errBadCursor = errors.New("bad cursor")

type row struct {
	n     int
	shard string
}

// numbers is a list over parts that each hold some numbers in order: a part's
// cursor is its last number.
func numbers(s *fanout.Set[[]int], fetches *atomic.Int32) fanout.List[[]int, row] {
	return fanout.List[[]int, row]{
		Name: "numbers",
		Fetch: func(i int, p []int, limit int, after string) ([]row, string, error) {
			fetches.Add(1)
			from := 0
			if after != "" {
				n, err := strconv.Atoi(after)
				if err != nil {
					return nil, "", errBadCursor
				}
				from, _ = slices.BinarySearch(p, n+1)
			}
			var out []row
			for _, n := range p[from:min(len(p), from+limit)] {
				out = append(out, row{n: n, shard: s.Name(i)})
			}
			next := ""
			if from+limit < len(p) {
				next = strconv.Itoa(out[len(out)-1].n)
			}
			return out, next, nil
		},
		Order:     func(x, y row) int { return cmp.Compare(x.n, y.n) },
		Cursor:    func(x row) string { return strconv.Itoa(x.n) },
		BadCursor: func(msg string) error { return fmt.Errorf("%w: %s", errBadCursor, msg) },
		Join: func(errs []error) error {
			return s.Join(errs, func(err error) bool { return errors.Is(err, errBadCursor) },
				func(name string, err error) error { return fmt.Errorf("on %s: %w", name, err) })
		},
	}
}

func all(t *testing.T, l fanout.List[[]int, row], s *fanout.Set[[]int], limit int) (out []row, cursors []string) {
	after := ""
	for range 100 {
		rows, next, err := l.Page(s, after, limit)
		require.NoError(t, err)
		require.LessOrEqual(t, len(rows), limit)
		out = append(out, rows...)
		if next == "" {
			return out, cursors
		}
		cursors = append(cursors, next)
		after = next
	}
	t.Fatal("paging does not end")
	return nil, nil
}

// TestListOneDatabase: with one database, a page, its cursor and its errors are
// the part's own.
func TestListOneDatabase(t *testing.T) {
	t.Parallel()
	s, err := fanout.Build(nil, []int{1, 2, 3, 4, 5}, func(shard.Shard) []int { panic("no shards") },
		func(p []int) ([]int, error) { return p, nil })
	require.NoError(t, err)
	var fetches atomic.Int32
	l := numbers(s, &fetches)
	rows, cursors := all(t, l, s, 2)
	require.Equal(t, []row{{n: 1}, {n: 2}, {n: 3}, {n: 4}, {n: 5}}, rows)
	require.Equal(t, []string{"2", "4"}, cursors, "the part's own cursors")
	require.EqualValues(t, 3, fetches.Load())
	_, _, err = l.Page(s, "x", 2)
	require.Same(t, errBadCursor, err, "the part's own error")
}

func TestListShardMap(t *testing.T) {
	t.Parallel()
	data := map[string][]int{"s1": {1, 4, 5, 9}, "s2": {2, 3, 10}, "s3": {}}
	m := &shard.Map{Shards: []shard.Shard{{Name: "s1"}, {Name: "s2"}, {Name: "s3"}}}
	s, err := fanout.Build(m, nil, func(sh shard.Shard) []int { return data[sh.Name] },
		func(p []int) ([]int, error) { return p, nil })
	require.NoError(t, err)
	var fetches atomic.Int32
	l := numbers(s, &fetches)
	for limit := 1; limit <= 8; limit++ {
		rows, _ := all(t, l, s, limit)
		require.Equal(t, []row{{1, "s1"}, {2, "s2"}, {3, "s2"}, {4, "s1"}, {5, "s1"}, {9, "s1"}, {10, "s2"}}, rows, "limit %d", limit)
	}
	// A row inserted before a part's cursor meanwhile is not read again, nor one
	// after it skipped.
	rows, next, err := l.Page(s, "", 3)
	require.NoError(t, err)
	require.Equal(t, []row{{1, "s1"}, {2, "s2"}, {3, "s2"}}, rows)
	data["s1"] = []int{0, 1, 4, 5, 9}
	data["s3"] = []int{6}
	s, err = fanout.Build(m, nil, func(sh shard.Shard) []int { return data[sh.Name] },
		func(p []int) ([]int, error) { return p, nil })
	require.NoError(t, err)
	l = numbers(s, &fetches)
	rows, next, err = l.Page(s, next, 10)
	require.NoError(t, err)
	require.Equal(t, []row{{4, "s1"}, {5, "s1"}, {6, "s3"}, {9, "s1"}, {10, "s2"}}, rows)
	require.Empty(t, next)

	for _, c := range []string{"x", "eyJsaXN0Ijoib3RoZXIifQ", "eyJsaXN0IjoibnVtYmVycyIsInNoYXJkcyI6eyJzOSI6IjEifX0"} {
		_, _, err = l.Page(s, c, 2)
		require.ErrorIs(t, err, errBadCursor, c)
	}
}

func TestJoinLookupStray(t *testing.T) {
	t.Parallel()
	alike := func(err error) bool { return errors.Is(err, errBadCursor) }
	wrap := func(name string, err error) error { return fmt.Errorf("on %s: %w", name, err) }
	missing := errors.New("missing")
	isMissing := func(err error) bool { return errors.Is(err, missing) }

	one, err := fanout.Build(nil, "db", func(shard.Shard) string { panic("no shards") }, func(c string) (string, error) { return c, nil })
	require.NoError(t, err)
	boom := errors.New("boom")
	require.Same(t, boom, one.Join([]error{boom}, alike, wrap), "one database's error as it is")
	_, at, errs, miss := fanout.Lookup(one, "t", func(int, string) (int, error) { return 0, missing }, isMissing)
	require.Equal(t, -1, at)
	require.Equal(t, []error{nil}, errs)
	require.Same(t, missing, miss)
	_, on, _, errs, err := fanout.Stray(one, func(int, string) ([]string, error) { panic("one database has no stray rows") })
	require.NoError(t, err)
	require.Equal(t, -1, on)
	require.Equal(t, []error{nil}, errs)

	m := &shard.Map{Shards: []shard.Shard{{Name: "s1"}, {Name: "s2"}, {Name: "s3"}}, Table: map[string]string{"acme": "s3"}}
	s, err := fanout.Build(m, "", func(sh shard.Shard) string { return sh.Name }, func(c string) (string, error) { return c, nil })
	require.NoError(t, err)
	require.NoError(t, s.Join([]error{nil, nil, nil}, alike, wrap))
	require.EqualError(t, s.Join([]error{nil, boom, nil}, alike, wrap), "on s2: boom")
	require.EqualError(t, s.Join([]error{boom, boom, nil}, alike, wrap), "on s1: boom\non s2: boom")
	require.Same(t, errBadCursor, s.Join([]error{boom, errBadCursor, nil}, alike, wrap), "an error every part gives alike, as it is")

	// The routed shard's row first, then map order.
	r, at, _, _ := fanout.Lookup(s, "acme", func(i int, p string) (string, error) { return p, nil }, isMissing)
	require.Equal(t, "s3", r)
	require.Equal(t, 2, at)
	r, at, _, _ = fanout.Lookup(s, "acme", func(i int, p string) (string, error) {
		if p == "s3" {
			return "", missing
		}
		return p, nil
	}, isMissing)
	require.Equal(t, "s1", r)
	require.Equal(t, 0, at)
	_, at, errs, miss = fanout.Lookup(s, "acme", func(i int, p string) (string, error) {
		if p == "s2" {
			return "", boom
		}
		return "", missing
	}, isMissing)
	require.Equal(t, -1, at)
	require.Equal(t, []error{nil, boom, nil}, errs)
	require.Same(t, missing, miss)

	tenant, on, want, _, err := fanout.Stray(s, func(i int, p string) ([]string, error) {
		if p == "s1" {
			return []string{"acme"}, nil
		}
		return nil, nil
	})
	require.NoError(t, err)
	require.Equal(t, "acme", tenant)
	require.Equal(t, []int{0, 2}, []int{on, want})
	_, on, _, errs, _ = fanout.Stray(s, func(i int, p string) ([]string, error) {
		if p == "s2" {
			return nil, boom
		}
		return []string{"acme"}, nil
	})
	require.Equal(t, -1, on)
	require.Equal(t, []error{nil, boom, nil}, errs)

	n, err := fanout.Whole(one, func(p string) (int, error) { return 1, nil }, func() (int, error) { return 2, nil })
	require.NoError(t, err)
	require.Equal(t, 1, n)
	n, err = fanout.Whole(s, func(p string) (int, error) { return 1, nil }, func() (int, error) { return 2, nil })
	require.NoError(t, err)
	require.Equal(t, 2, n)
}
