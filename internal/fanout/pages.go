package fanout

import (
	"cmp"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"slices"

	"github.com/idemkit/idem/internal/text"
)

// Join returns the parts' errors (errs, one a part in map order, nil for a part
// that did not fail) as one error, nil when none failed. The part of one
// database's error is returned as it is. A shard's error becomes wrap(name,
// err), and the shards' errors are joined (one alone is returned as wrap made
// it); an error for which alike holds (one that every part gives alike, such as
// a bad filter) is returned as it is, for all.
func (s *Set[T]) Join(errs []error, alike func(error) bool, wrap func(name string, err error) error) error {
	if s.m == nil {
		return errs[0]
	}
	var out []error
	for i, err := range errs {
		switch {
		case err == nil:
		case alike(err):
			return err
		default:
			out = append(out, wrap(s.Name(i), err))
		}
	}
	if len(out) == 1 {
		return out[0]
	}
	return errors.Join(out...)
}

// Lookup finds a row that lives on one part: it runs fn on every part at once
// and returns the result of the first part that has the row (fn did not fail),
// the part the tenant routes to first, then the others in map order. at is that
// part, -1 when none has it; then errs are the parts' errors other than missing
// ones, and miss the first missing one (for one database, its own).
func Lookup[T, R any](s *Set[T], tenant string, fn func(i int, p T) (R, error), missing func(error) bool) (r R, at int, errs []error, miss error) {
	res, errs := Collect(s, fn)
	order := make([]int, 0, len(res))
	if i, err := s.Index(tenant); err == nil {
		order = append(order, i)
	}
	for i := range res {
		if !slices.Contains(order, i) {
			order = append(order, i)
		}
	}
	for _, i := range order {
		if errs[i] == nil {
			return res[i], i, nil, nil
		}
		if missing(errs[i]) {
			miss = cmp.Or(miss, errs[i])
			errs[i] = nil
		}
	}
	return r, -1, errs, miss
}

// Stray looks for a tenant that has rows on a part its route does not name:
// read returns, on one part, the tenants of the rows in question there. It
// returns the first such tenant, the part its rows are on and the part its
// route names; on is -1 when there is none. errs are read's errors, one a part;
// err is a route's error (shard.ErrRoute). With one database every tenant
// routes to the one part: read is not called.
func Stray[T any](s *Set[T], read func(i int, p T) ([]string, error)) (tenant string, on, want int, errs []error, err error) {
	if s.m == nil {
		return "", -1, -1, []error{nil}, nil
	}
	res, errs := Collect(s, read)
	if slices.ContainsFunc(errs, func(err error) bool { return err != nil }) {
		return "", -1, -1, errs, nil
	}
	for i, tenants := range res {
		for _, t := range tenants {
			r, err := s.m.Index(t)
			if err != nil {
				return "", -1, -1, errs, err
			}
			if r != i {
				return t, i, r, errs, nil
			}
		}
	}
	return "", -1, -1, errs, nil
}

// List is a list whose rows live on the parts, each part's in the list's order
// and paged by its own keyset cursor; Page merges them into one page.
type List[T, R any] struct {
	// Name is the list's name, held in a merged cursor.
	Name string
	// Fetch reads part p's page of at most limit rows after its cursor after ("":
	// from the start), and its cursor for the next page ("" on its last).
	Fetch func(i int, p T, limit int, after string) (rows []R, next string, err error)
	// Order is the list's order across parts (ties go by map order).
	Order func(x, y R) int
	// Cursor is a part's cursor after row x.
	Cursor func(x R) string
	// BadCursor is the error of a cursor this list did not return.
	BadCursor func(msg string) error
	// Join makes one error of the parts' errors (see Set.Join).
	Join func(errs []error) error
}

// mergedCursor is a merged page's cursor: each shard's own cursor (its last row
// on the pages so far), as base64url of JSON. A shard without one starts from
// its beginning.
type mergedCursor struct {
	List   string            `json:"list"`
	Shards map[string]string `json:"shards"`
}

// Page returns one page of at most limit rows after the cursor after ("": the
// first page), and the cursor of the next page ("" on the last one).
//
// With one database the page, its cursor and its errors are the part's own.
// With a shard map, it fetches a page of limit rows from every shard (each after
// its own cursor) and merges them in the list's order into one page of at most
// limit rows: a shard's cursor moves to its last row on the page, one with no
// row on it stays where it was, and there is a next page when any shard has rows
// left, on its own page or after it. So a page has no gap and no duplicate
// across shards, whatever is inserted meanwhile.
func (l List[T, R]) Page(s *Set[T], after string, limit int) ([]R, string, error) {
	if s.m == nil {
		return l.Fetch(0, s.parts[0], limit, after)
	}
	cur, err := l.decode(s, after)
	if err != nil {
		return nil, "", err
	}
	type page struct {
		rows []R
		more bool
	}
	pages, errs := Collect(s, func(i int, p T) (page, error) {
		rows, next, err := l.Fetch(i, p, limit, cur[s.Name(i)])
		return page{rows, next != ""}, err
	})
	if err := l.Join(errs); err != nil {
		return nil, "", err
	}
	out := []R{}
	taken := make([]int, len(pages))
	for len(out) < limit {
		best := -1
		for i, p := range pages {
			if taken[i] < len(p.rows) && (best < 0 || l.Order(p.rows[taken[i]], pages[best].rows[taken[best]]) < 0) {
				best = i
			}
		}
		if best < 0 {
			break
		}
		out = append(out, pages[best].rows[taken[best]])
		taken[best]++
	}
	more := false
	next := make(map[string]string, len(pages))
	for i, p := range pages {
		name := s.Name(i)
		if taken[i] > 0 {
			next[name] = l.Cursor(p.rows[taken[i]-1])
		} else if c, ok := cur[name]; ok {
			next[name] = c
		}
		more = more || p.more || taken[i] < len(p.rows)
	}
	if !more {
		return out, "", nil
	}
	b, _ := json.Marshal(mergedCursor{List: l.Name, Shards: next})
	return out, base64.RawURLEncoding.EncodeToString(b), nil
}

// decode reads a merged cursor of the list: each shard's cursor by name.
func (l List[T, R]) decode(s *Set[T], c string) (map[string]string, error) {
	if c == "" {
		return map[string]string{}, nil
	}
	var mc mergedCursor
	b, err := base64.RawURLEncoding.DecodeString(c)
	if err == nil {
		err = json.Unmarshal(b, &mc)
	}
	if err != nil || mc.List != l.Name {
		return nil, l.BadCursor(fmt.Sprintf("page cursor %q is not one that the %s list of a shard map returned", text.Clip(c, 40), l.Name))
	}
	for name := range mc.Shards {
		if s.IndexOf(name) < 0 || name == "" {
			return nil, l.BadCursor(fmt.Sprintf("page cursor names shard %q, which is not a shard of the map", text.Clip(name, 40)))
		}
	}
	if mc.Shards == nil {
		mc.Shards = map[string]string{}
	}
	return mc.Shards, nil
}

// Whole returns a result that the parts' results cannot be merged into row by
// row (a list whose rows on several shards merge into one row, paged by the
// merged rows): with one database, one(p) on the one part, its own result as it
// is; with a shard map, many(), which reads every part and merges.
func Whole[T, R any](s *Set[T], one func(p T) (R, error), many func() (R, error)) (R, error) {
	if s.m == nil {
		return one(s.parts[0])
	}
	return many()
}
