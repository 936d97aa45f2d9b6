package admin

import (
	"cmp"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/text"
)

// An Admin over a shard map (Config.Shards) runs every read and action on each
// shard, in parallel, and merges:
//
//   - lists (inbox keys, effects, repair actions) merge the shards' pages in the
//     list's order, ties by shard order, and page with a cursor that carries each
//     shard's own keyset position, so a page has no gap and no duplicate across
//     shards, whatever is inserted meanwhile;
//   - a failure group's ID is the same on every shard: the list of groups shows
//     one row a group, its shards' parts merged (sum of counts, earliest first
//     and latest last failure, its shards), Group the same with each shard's
//     part, and an action acts on each shard's rows of the group;
//   - Stats sums per consumer and kind, and lists each shard's own figures;
//   - one key (InspectInbox, InspectEffect, Forget, Requeue) is looked up on every
//     shard, so a tenant's rows are found wherever the route put them;
//   - an action (Requeue, RequeueDead, Forget, RetryGroup, DiscardGroup,
//     ReleaseGroup) changes a tenant's rows only on the shard its route names: it
//     is refused (ErrOffRoute, nothing changed) when some of the rows it would
//     change are on another shard.
//
// A shard that does not answer is never a silent gap: a list, a lookup that did
// not find the key elsewhere, or an action fails with a *ShardError naming it
// (errors.Is ErrShardUnavailable). Stats alone returns what the other shards
// answered together with that error, and marks the shard in Stats.Shards.

// ErrShardUnavailable is wrapped by a *ShardError whose shard could not be read
// (Postgres unreachable, the connection broke): the result would miss that shard's
// rows, so none is returned (Stats returns the others' figures too).
var ErrShardUnavailable = errcode.Transient("shard_unavailable", "a shard did not answer")

// ErrOffRoute is returned, and nothing was changed, when an action (a requeue, a
// forget, a failure group's retry, discard or release) would change a tenant's
// rows on a shard that the map's route does not name for the tenant: rows that a
// tenant move left behind or has not finished copying. Acting there too would
// repair the same failure twice (once on each shard). Finish the move
// (MoveTenant, run again) and switch the route to the shard that holds the rows;
// then act again.
var ErrOffRoute = errcode.Transient("off_route", "a tenant has rows on a shard its route does not name: finish its move first")

// ShardError is an error of one shard of the map. Its code is the shard error's
// own when it has one (not_found, schema_missing...), else shard_unavailable.
type ShardError struct {
	Shard string
	Err   error
}

func (e *ShardError) Error() string {
	return fmt.Sprintf("idem: shard %q: %v", e.Shard, strings.TrimPrefix(e.Err.Error(), "idem: "))
}

// Unwrap gives the shard's error, and ErrShardUnavailable when that one has no
// code of its own.
func (e *ShardError) Unwrap() []error {
	if errcode.Code(e.Err) != "" {
		return []error{e.Err}
	}
	return []error{ErrShardUnavailable, e.Err}
}

// Code is the code of the shard's error, else shard_unavailable.
func (e *ShardError) Code() string { return cmp.Or(errcode.Code(e.Err), ErrShardUnavailable.Code()) }

// shardErrors joins the errors of the shards that failed into one, nil when none
// did. An error that every shard would give alike (a bad filter or cursor) is
// returned as it is.
func shardErrors(names []string, errs []error) error {
	var out []error
	for i, err := range errs {
		switch {
		case err == nil:
		case errors.Is(err, ErrBadFilter), errors.Is(err, ErrBadCursor), errors.Is(err, ErrWrongSource),
			errors.Is(err, ErrNoteRequired), errors.Is(err, ErrInvalidConfig):
			return err
		default:
			out = append(out, &ShardError{Shard: names[i], Err: err})
		}
	}
	if len(out) == 1 {
		return out[0]
	}
	return errors.Join(out...)
}

// fan runs fn on every shard's Admin at once and returns each result and error in
// map order.
func fan[T any](ctx context.Context, a *Admin, fn func(ctx context.Context, s *Admin) (T, error)) ([]T, []error) {
	res := make([]T, len(a.shards))
	errs := make([]error, len(a.shards))
	var wg sync.WaitGroup
	for i, s := range a.shards {
		wg.Go(func() { res[i], errs[i] = fn(ctx, s) })
	}
	wg.Wait()
	return res, errs
}

// Shards are the names of the shards of Config.Shards, in map order; nil for one
// database.
func (a *Admin) Shards() []string {
	if a.shards == nil {
		return nil
	}
	return a.names()
}

func (a *Admin) names() []string {
	out := make([]string, len(a.shards))
	for i, s := range a.shards {
		out[i] = s.name
	}
	return out
}

// shardCursor is a merged list's cursor: each shard's own cursor (its last row
// on the pages so far), as base64url of JSON. A shard without one starts from
// its beginning.
type shardCursor struct {
	List   string            `json:"list"`
	Shards map[string]string `json:"shards"`
}

func (a *Admin) decodeShardCursor(list, c string) (map[string]string, error) {
	if c == "" {
		return map[string]string{}, nil
	}
	var sc shardCursor
	b, err := base64.RawURLEncoding.DecodeString(c)
	if err == nil {
		err = json.Unmarshal(b, &sc)
	}
	if err != nil || sc.List != list {
		return nil, errorf(ErrBadCursor, "page cursor %q is not one that the %s list of a shard map returned", text.Clip(c, 40), list)
	}
	for name := range sc.Shards {
		if !slices.Contains(a.names(), name) {
			return nil, errorf(ErrBadCursor, "page cursor names shard %q, which is not a shard of the map", text.Clip(name, 40))
		}
	}
	if sc.Shards == nil {
		sc.Shards = map[string]string{}
	}
	return sc.Shards, nil
}

func encodeShardCursor(list string, shards map[string]string) string {
	b, _ := json.Marshal(shardCursor{List: list, Shards: shards})
	return base64.RawURLEncoding.EncodeToString(b)
}

// shardPage is one shard's page: its rows, in list order, and whether it has more.
type shardPage[T any] struct {
	rows []T
	more bool
}

// mergePages fetches a page of limit rows from every shard (each after its own
// cursor) and merges them in the list's order (cmp, then shard order) into one
// page of at most limit rows. A shard's cursor moves to its last row on the page;
// one with no row on it stays where it was. There is a next page when any shard
// has rows left, on its own page or after it.
func mergePages[T any](ctx context.Context, a *Admin, list, after string, limit int,
	fetch func(ctx context.Context, s *Admin, p Page) (shardPage[T], error),
	order func(x, y T) int, cursor func(T) string, setShard func(*T, string)) ([]T, string, error) {
	cur, err := a.decodeShardCursor(list, after)
	if err != nil {
		return nil, "", err
	}
	pages, errs := fan(ctx, a, func(ctx context.Context, s *Admin) (shardPage[T], error) {
		return fetch(ctx, s, Page{Limit: limit, After: cur[s.name]})
	})
	if err := shardErrors(a.names(), errs); err != nil {
		return nil, "", err
	}
	out := []T{}
	taken := make([]int, len(pages))
	for len(out) < limit {
		best := -1
		for i, p := range pages {
			if taken[i] < len(p.rows) && (best < 0 || order(p.rows[taken[i]], pages[best].rows[taken[best]]) < 0) {
				best = i
			}
		}
		if best < 0 {
			break
		}
		row := pages[best].rows[taken[best]]
		setShard(&row, a.shards[best].name)
		out = append(out, row)
		taken[best]++
	}
	more := false
	next := make(map[string]string, len(pages))
	for i, p := range pages {
		name := a.shards[i].name
		if taken[i] > 0 {
			next[name] = cursor(p.rows[taken[i]-1])
		} else if c, ok := cur[name]; ok {
			next[name] = c
		}
		more = more || p.more || taken[i] < len(p.rows)
	}
	if !more {
		return out, "", nil
	}
	return out, encodeShardCursor(list, next), nil
}

func (a *Admin) shardedListInbox(ctx context.Context, f InboxFilter, p Page) (*InboxPage, error) {
	limit, err := p.limit()
	if err != nil {
		return nil, err
	}
	keys, next, err := mergePages(ctx, a, "inbox", p.After, limit,
		func(ctx context.Context, s *Admin, p Page) (shardPage[InboxKey], error) {
			pg, err := s.ListInbox(ctx, f, p)
			if err != nil {
				return shardPage[InboxKey]{}, err
			}
			return shardPage[InboxKey]{pg.Keys, pg.Next != ""}, nil
		},
		func(x, y InboxKey) int {
			return cmp.Or(cmp.Compare(x.Consumer, y.Consumer), cmp.Compare(x.Tenant, y.Tenant), cmp.Compare(x.Key, y.Key))
		},
		func(k InboxKey) string { return encodeCursor("inbox", k.Consumer, k.Tenant, k.Key) },
		func(k *InboxKey, name string) { k.Shard = name })
	if err != nil {
		return nil, err
	}
	return &InboxPage{Keys: keys, Next: next}, nil
}

func (a *Admin) shardedListEffects(ctx context.Context, f EffectFilter, p Page) (*EffectPage, error) {
	limit, err := p.limit()
	if err != nil {
		return nil, err
	}
	effs, next, err := mergePages(ctx, a, "effects", p.After, limit,
		func(ctx context.Context, s *Admin, p Page) (shardPage[Effect], error) {
			pg, err := s.ListEffects(ctx, f, p)
			if err != nil {
				return shardPage[Effect]{}, err
			}
			return shardPage[Effect]{pg.Effects, pg.Next != ""}, nil
		},
		func(x, y Effect) int {
			return cmp.Or(cmp.Compare(x.Tenant, y.Tenant), cmp.Compare(x.Kind, y.Kind), cmp.Compare(x.Key, y.Key))
		},
		func(e Effect) string { return encodeCursor("effects", e.Tenant, e.Kind, e.Key) },
		func(e *Effect, name string) { e.Shard = name })
	if err != nil {
		return nil, err
	}
	return &EffectPage{Effects: effs, Next: next}, nil
}

// shardedListGroups lists the failure groups of every shard merged by ID: a group
// whose failures are on several shards is one row, with the sum of their counts,
// the earliest first and the latest last failure, the shards that hold it (Shard)
// and each one's part (Parts). A merged group's place in the order depends on
// every shard's part, so each page reads every group of the filter on every
// shard (one aggregate a shard, all its groups held for the merge, without their
// samples), merges them and pages with the same keyset cursor as one database
// (the order's value and the ID): a group that is there for the whole paging
// appears once, on its merged count's page. (A database aggregates every failure
// for each page of groups already; one database alike.) Then each shard that
// holds some of the page's groups reads their codes, texts and sample keys, with
// one statement: the samples cost grows with the page, not with the groups.
func (a *Admin) shardedListGroups(ctx context.Context, f GroupFilter, p Page) (*GroupPage, error) {
	gp, err := f.paging(p)
	if err != nil {
		return nil, err
	}
	order, limit, afterValue, afterID := gp.order, gp.limit, gp.afterValue, gp.afterID
	// Every group of the filter on each shard, from one aggregate of its failures:
	// each group there once, with one count.
	all, errs := fan(ctx, a, func(ctx context.Context, s *Admin) ([]FailureGroup, error) { return s.groupCounts(ctx, f, gp) })
	if err := shardErrors(a.names(), errs); err != nil {
		return nil, err
	}
	parts := map[string][]*FailureGroup{} // by ID, in map order
	var ids []string
	for i := range all {
		for j := range all[i] {
			g := &all[i][j]
			g.Shard = a.shards[i].name
			if parts[g.ID] == nil {
				ids = append(ids, g.ID)
			}
			parts[g.ID] = append(parts[g.ID], g)
		}
	}
	// The merged groups past the cursor, by their counts and times alone.
	merged := make([]FailureGroup, 0, len(ids))
	for _, id := range ids {
		g := mergeGroup(parts[id], 0)
		if p.After == "" || groupValue(*g, order) < afterValue || groupValue(*g, order) == afterValue && g.ID > afterID {
			merged = append(merged, *g)
		}
	}
	slices.SortFunc(merged, func(x, y FailureGroup) int {
		return cmp.Or(cmp.Compare(groupValue(y, order), groupValue(x, order)), cmp.Compare(x.ID, y.ID))
	})
	out := &GroupPage{Groups: merged[:min(limit, len(merged))]}
	if len(merged) > limit {
		out.Next = encodeGroupCursor(merged[limit-1], order)
	}
	// The page's groups' samples, read on the shards that hold them, then merged.
	onShard := map[string][]*FailureGroup{}
	for _, g := range out.Groups {
		for _, part := range parts[g.ID] {
			onShard[part.Shard] = append(onShard[part.Shard], part)
		}
	}
	_, errs = fan(ctx, a, func(ctx context.Context, s *Admin) (struct{}, error) {
		if len(onShard[s.name]) == 0 {
			return struct{}{}, nil
		}
		return struct{}{}, s.sampleGroups(ctx, onShard[s.name], f.Seen, ListSamples)
	})
	if err := shardErrors(a.names(), errs); err != nil {
		return nil, err
	}
	for i, g := range out.Groups {
		out.Groups[i] = *mergeGroup(parts[g.ID], ListSamples)
	}
	return out, nil
}

// mergeGroup merges one group's parts, each read on the shard its Shard names, in
// map order: the sum of the counts, the earliest first and the latest last
// failure, the latest part's code, texts and sample keys first (at most samples
// keys), the shards comma-separated and each one's part. Attempts and Actions are
// left to the caller.
func mergeGroup(parts []*FailureGroup, samples int) *FailureGroup {
	out := *parts[0]
	out.Attempts, out.Actions, out.SampleKeys, out.Count = nil, nil, nil, 0
	latest := parts[0]
	names := make([]string, len(parts))
	for i, g := range parts {
		names[i] = g.Shard
		out.Count += g.Count
		out.FirstSeen = minTime(out.FirstSeen, g.FirstSeen)
		out.LastSeen = maxTime(out.LastSeen, g.LastSeen)
		if g.LastSeen.After(latest.LastSeen) {
			latest = g
		}
		out.Parts = append(out.Parts, GroupPart{Shard: g.Shard, Count: g.Count, FirstSeen: g.FirstSeen, LastSeen: g.LastSeen})
	}
	out.Shard = strings.Join(names, ",")
	out.Code, out.Masked, out.Example = latest.Code, latest.Masked, latest.Example
	out.SampleKeys = slices.Clone(latest.SampleKeys)
	for _, g := range parts {
		if g != latest {
			out.SampleKeys = append(out.SampleKeys, g.SampleKeys...)
		}
	}
	out.SampleKeys = out.SampleKeys[:min(len(out.SampleKeys), samples)]
	return &out
}

func (a *Admin) shardedListActions(ctx context.Context, f ActionFilter, p Page) (*ActionPage, error) {
	limit, err := p.limit()
	if err != nil {
		return nil, err
	}
	acts, next, err := mergePages(ctx, a, "actions", p.After, limit,
		func(ctx context.Context, s *Admin, p Page) (shardPage[FailureAction], error) {
			pg, err := s.ListActions(ctx, f, p)
			if err != nil {
				return shardPage[FailureAction]{}, err
			}
			return shardPage[FailureAction]{pg.Actions, pg.Next != ""}, nil
		},
		func(x, y FailureAction) int {
			return cmp.Or(cmp.Compare(y.At.UnixMicro(), x.At.UnixMicro()), cmp.Compare(y.ID, x.ID))
		},
		func(x FailureAction) string { return encodeCursor("actions", fmt.Sprint(x.At.UnixMicro()), x.ID, "") },
		func(x *FailureAction, name string) { x.Shard = name })
	if err != nil {
		return nil, err
	}
	return &ActionPage{Actions: acts, Next: next}, nil
}

// ShardStats is one shard's figures in Stats.
type ShardStats struct {
	Shard  string `json:"shard"`
	Schema string `json:"schema"`
	// Error says why the shard did not answer; its figures are then empty.
	Error     string          `json:"error,omitempty"`
	Consumers []ConsumerStats `json:"consumers"`
	Effects   []KindStats     `json:"effects"`
}

// Up says whether the shard answered.
func (s ShardStats) Up() bool { return s.Error == "" }

func (a *Admin) shardedStats(ctx context.Context) (*Stats, error) {
	res, errs := fan(ctx, a, func(ctx context.Context, s *Admin) (*Stats, error) { return s.Stats(ctx) })
	out := &Stats{Schema: a.Schema(), Consumers: []ConsumerStats{}, Effects: []KindStats{}}
	consumers := map[string]*ConsumerStats{}
	kinds := map[string]*KindStats{}
	for i, st := range res {
		ss := ShardStats{Shard: a.shards[i].name, Schema: a.shards[i].cfg.Schema, Consumers: []ConsumerStats{}, Effects: []KindStats{}}
		if errs[i] != nil {
			ss.Error = errs[i].Error()
			out.Shards = append(out.Shards, ss)
			continue
		}
		ss.Consumers, ss.Effects = st.Consumers, st.Effects
		out.Shards = append(out.Shards, ss)
		for _, c := range st.Consumers {
			m := consumers[c.Consumer]
			if m == nil {
				m = &ConsumerStats{Consumer: c.Consumer}
				consumers[c.Consumer] = m
			}
			m.Rows += c.Rows
			m.Completed += c.Completed
			m.Failed += c.Failed
			m.Processing += c.Processing
			m.Expired += c.Expired
			if c.Oldest != nil && (m.Oldest == nil || c.Oldest.Before(*m.Oldest)) {
				m.Oldest = c.Oldest
			}
			m.OldestProcessingSeconds = max(m.OldestProcessingSeconds, c.OldestProcessingSeconds)
		}
		for _, k := range st.Effects {
			m := kinds[k.Kind]
			if m == nil {
				m = &KindStats{Kind: k.Kind}
				kinds[k.Kind] = m
			}
			m.Pending += k.Pending
			m.Due += k.Due
			m.Dead += k.Dead
			m.Done += k.Done
			m.Discarded += k.Discarded
			m.InFlight += k.InFlight
			m.Stuck += k.Stuck
			m.OldestPendingSeconds = max(m.OldestPendingSeconds, k.OldestPendingSeconds)
		}
	}
	for _, name := range slices.Sorted(maps.Keys(consumers)) {
		out.Consumers = append(out.Consumers, *consumers[name])
	}
	for _, name := range slices.Sorted(maps.Keys(kinds)) {
		out.Effects = append(out.Effects, *kinds[name])
	}
	return out, shardErrors(a.names(), errs)
}

// lookup runs a one-key read on every shard and returns the row of the first
// shard (in map order, the tenant's routed shard first) that has it. ErrNotFound
// is returned only when every shard answered and none has it; otherwise the
// shards' errors.
func lookup[T any](ctx context.Context, a *Admin, tenant string, fn func(ctx context.Context, s *Admin) (T, error), setShard func(T, string)) (T, error) {
	res, errs := fan(ctx, a, fn)
	order := make([]int, 0, len(res))
	if i, err := a.cfg.Shards.Index(tenant); err == nil {
		order = append(order, i)
	}
	for i := range res {
		if !slices.Contains(order, i) {
			order = append(order, i)
		}
	}
	var notFound error
	for _, i := range order {
		if errs[i] == nil {
			setShard(res[i], a.shards[i].name)
			return res[i], nil
		}
		if errors.Is(errs[i], ErrNotFound) {
			notFound = errs[i]
			errs[i] = nil
		}
	}
	var zero T
	if err := shardErrors(a.names(), errs); err != nil {
		return zero, err
	}
	return zero, notFound
}

func (a *Admin) shardedInspectInbox(ctx context.Context, id inbox.ID, o InspectOptions) (*Inspection, error) {
	return lookup(ctx, a, id.Tenant, func(ctx context.Context, s *Admin) (*Inspection, error) { return s.InspectInbox(ctx, id, o) },
		func(x *Inspection, name string) {
			x.Shard = name
			for i := range x.Effects {
				x.Effects[i].Shard = name
			}
		})
}

func (a *Admin) shardedInspectEffect(ctx context.Context, id EffectID) (*Effect, error) {
	return lookup(ctx, a, id.Tenant, func(ctx context.Context, s *Admin) (*Effect, error) { return s.InspectEffect(ctx, id) },
		func(e *Effect, name string) { e.Shard = name })
}

func (a *Admin) shardedFind(ctx context.Context, key string, f FindFilter) (*Found, error) {
	res, errs := fan(ctx, a, func(ctx context.Context, s *Admin) (*Found, error) { return s.Find(ctx, key, f) })
	if err := shardErrors(a.names(), errs); err != nil {
		return nil, err
	}
	out := &Found{Key: key, Inbox: []InboxKey{}, Effects: []Effect{}}
	for i, r := range res {
		for _, k := range r.Inbox {
			k.Shard = a.shards[i].name
			out.Inbox = append(out.Inbox, k)
		}
		for _, e := range r.Effects {
			e.Shard = a.shards[i].name
			out.Effects = append(out.Effects, e)
		}
	}
	slices.SortStableFunc(out.Inbox, func(x, y InboxKey) int {
		return cmp.Or(cmp.Compare(x.Consumer, y.Consumer), cmp.Compare(x.Tenant, y.Tenant))
	})
	slices.SortStableFunc(out.Effects, func(x, y Effect) int {
		return cmp.Or(cmp.Compare(x.Tenant, y.Tenant), cmp.Compare(x.Kind, y.Kind))
	})
	out.Inbox = out.Inbox[:min(len(out.Inbox), FindLimit)]
	out.Effects = out.Effects[:min(len(out.Effects), FindLimit)]
	return out, nil
}

// shardedRequeue requeues the effect on the shard that has it dead, refused when
// that is not the shard the route names for its tenant.
func (a *Admin) shardedRequeue(ctx context.Context, id EffectID) error {
	if err := a.offRoute(ctx, "requeue of effect "+id.String(), func(ctx context.Context, s *Admin) ([]string, error) {
		return s.tenantsOf(ctx, `SELECT tenant FROM `+s.table("effects")+` WHERE tenant = $1 AND kind = $2 AND key = $3 AND state = 'dead'`,
			id.Tenant, id.Kind, id.Key)
	}); err != nil {
		return err
	}
	_, errs := fan(ctx, a, func(ctx context.Context, s *Admin) (struct{}, error) { return struct{}{}, s.Requeue(ctx, id) })
	var first error
	for i, err := range errs {
		switch {
		case err == nil:
			return nil
		case errors.Is(err, ErrNotFound):
			errs[i] = nil
		case errors.Is(err, ErrNotDead):
			first = cmp.Or(first, err)
			errs[i] = nil
		}
	}
	if err := shardErrors(a.names(), errs); err != nil {
		return err
	}
	return cmp.Or(first, errorf(ErrNotFound, "no effect %s on any shard", id))
}

func (a *Admin) shardedRequeueDead(ctx context.Context, f effectsdb.RequeueFilter) (int64, error) {
	if err := a.offRoute(ctx, "requeue", func(ctx context.Context, s *Admin) ([]string, error) {
		return s.tenantsOf(ctx, `SELECT DISTINCT tenant FROM `+s.table("effects")+`
			WHERE state = 'dead' AND ($1 = '' OR kind = $1) AND ($2 = '' OR key = $2) AND (($3 = '' AND NOT $4) OR tenant = $3)`,
			f.Kind, f.Key, f.Tenant, f.TenantExact)
	}); err != nil {
		return 0, err
	}
	res, errs := fan(ctx, a, func(ctx context.Context, s *Admin) (int64, error) { return s.RequeueDead(ctx, f) })
	var n int64
	for _, r := range res {
		n += r
	}
	return n, shardErrors(a.names(), errs)
}

// shardedForget forgets the key on the shard that has it, refused when that is
// not the shard the route names for its tenant, and returns the row it deleted.
func (a *Admin) shardedForget(ctx context.Context, id inbox.ID, audit Audit) (*InboxKey, error) {
	if err := id.Validate(); err != nil {
		return nil, err
	}
	if err := a.offRoute(ctx, "forget of inbox key "+formatID(id), func(ctx context.Context, s *Admin) ([]string, error) {
		return s.tenantsOf(ctx, `SELECT tenant FROM `+s.table("inbox")+` WHERE consumer = $1 AND tenant = $2 AND key = $3`,
			id.Consumer, id.Tenant, id.Key)
	}); err != nil {
		return nil, err
	}
	res, errs := fan(ctx, a, func(ctx context.Context, s *Admin) (*InboxKey, error) { return s.Forget(ctx, id, audit) })
	var held error
	var out *InboxKey
	for i, err := range errs {
		switch {
		case err == nil:
			if out == nil {
				out = res[i]
				out.Shard = a.shards[i].name
			}
		case errors.Is(err, ErrNotFound):
			errs[i] = nil
		case errors.Is(err, ErrLeaseHeld):
			held = cmp.Or(held, error(&ShardError{Shard: a.shards[i].name, Err: err}))
			errs[i] = nil
		}
	}
	if err := cmp.Or(held, shardErrors(a.names(), errs)); err != nil {
		return out, err
	}
	if out == nil {
		return nil, errorf(ErrNotFound, "no inbox key %s on any shard", formatID(id))
	}
	return out, nil
}

func (a *Admin) shardedGroup(ctx context.Context, id string, seen TimeRange) (*FailureGroup, error) {
	if _, err := parseGroupID(id); err != nil {
		return nil, err
	}
	res, errs := fan(ctx, a, func(ctx context.Context, s *Admin) (*FailureGroup, error) { return s.group(ctx, id, seen) })
	var parts []*FailureGroup
	attempts := map[int]int64{}
	for i, g := range res {
		if errors.Is(errs[i], ErrNotFound) {
			errs[i] = nil
			continue
		}
		if errs[i] != nil {
			continue
		}
		g.Shard = a.shards[i].name
		parts = append(parts, g)
		for _, at := range g.Attempts {
			attempts[at.Attempts] += at.Effects
		}
	}
	if err := shardErrors(a.names(), errs); err != nil {
		return nil, err
	}
	if parts == nil {
		return nil, errorf(ErrNotFound, "no failures in group %s on any shard (released, retried or discarded, or never there)", id)
	}
	out := mergeGroup(parts, GroupSamples)
	for _, n := range slices.Sorted(maps.Keys(attempts)) {
		out.Attempts = append(out.Attempts, AttemptsCount{Attempts: n, Effects: attempts[n]})
	}
	acts, err := a.ListActions(ctx, ActionFilter{Group: id}, Page{Limit: 20})
	if err != nil {
		return nil, err
	}
	out.Actions = acts.Actions
	return out, nil
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// shardedAct runs a repair action on every shard. A dry run sums the shards'
// plans. An action runs in one transaction per shard, taken one shard after the
// other in map order and all left open: when the rows they changed together pass
// AtMost, every one is rolled back (ErrGroupChanged); a shard the group has no
// row on is rolled back too, so that it records no empty action; the others
// commit, one after the other. A shard
// whose commit fails is named in the error, and the result says what the shards
// before it committed.
func (a *Admin) shardedAct(ctx context.Context, action, source string, act GroupAction) (*ActionResult, error) {
	g, err := parseGroupID(act.ID)
	if err != nil {
		return nil, err
	}
	if g.source != source {
		return a.shards[0].act(ctx, action, source, act) // its error says why
	}
	if err := a.offRoute(ctx, action+" of group "+act.ID, func(ctx context.Context, s *Admin) ([]string, error) {
		if source == SourceInbox {
			return s.tenantsOf(ctx, `SELECT DISTINCT tenant FROM `+s.table("inbox")+` WHERE error_group = $1 AND state = 'failed'`, g.hash)
		}
		return s.tenantsOf(ctx, `SELECT DISTINCT tenant FROM `+s.table("effects")+` WHERE error_group = $1 AND state = 'dead'`, g.hash)
	}); err != nil {
		return nil, err
	}
	type done struct {
		res *ActionResult
		tx  pgx.Tx
	}
	atMost := act.AtMost
	act.AtMost = 0
	step := func(ctx context.Context, s *Admin) (done, error) {
		if act.DryRun {
			r, err := s.act(ctx, action, source, act)
			return done{res: r}, err
		}
		pool, ok := s.db.(interface {
			Begin(context.Context) (pgx.Tx, error)
		})
		if !ok {
			return done{}, errcode.InvalidConfig("shard %q: its pool cannot begin a transaction", s.name)
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			return done{}, err
		}
		r, err := s.withDB(tx).act(ctx, action, source, act)
		if err != nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
			return done{}, err
		}
		return done{res: r, tx: tx}, nil
	}
	var parts []done
	var errs []error
	if act.DryRun {
		parts, errs = fan(ctx, a, step)
	} else {
		// One shard after the other, in map order: two actions on a group at once
		// take its rows' locks shard by shard in the same order, so neither holds
		// one shard's rows while it waits for the other's on another shard, a wait
		// that no database would see as a deadlock.
		parts, errs = make([]done, len(a.shards)), make([]error, len(a.shards))
		for i, s := range a.shards {
			if parts[i], errs[i] = step(ctx, s); errs[i] != nil {
				break
			}
		}
	}
	rollback := func() {
		for _, p := range parts {
			if p.tx != nil {
				_ = p.tx.Rollback(context.WithoutCancel(ctx))
			}
		}
	}
	if err := shardErrors(a.names(), errs); err != nil {
		rollback()
		return nil, err
	}
	out := &ActionResult{Action: action, Group: act.ID, DryRun: act.DryRun, Since: act.Since, Through: act.Through, Keys: []string{}, Shards: map[string]int64{}}
	var ids []string
	for i, p := range parts {
		out.Rows += p.res.Rows
		out.Keys = append(out.Keys, p.res.Keys...)
		out.Who, out.Why, out.At = p.res.Who, p.res.Why, maxTime(out.At, p.res.At)
		if p.res.Rows > 0 {
			out.Shards[a.shards[i].name] = p.res.Rows
		}
	}
	if atMost > 0 && out.Rows > atMost {
		rollback()
		return nil, errorf(ErrGroupChanged, "%s of group %s would change more than the %d row(s) planned: failures arrived within the bound since; nothing was changed, look again", action, act.ID, atMost)
	}
	for i, p := range parts {
		if p.tx == nil {
			continue
		}
		if p.res.Rows == 0 {
			_ = p.tx.Rollback(context.WithoutCancel(ctx))
			continue
		}
		if err := p.tx.Commit(ctx); err != nil {
			for _, q := range parts[i+1:] {
				if q.tx != nil {
					_ = q.tx.Rollback(context.WithoutCancel(ctx))
				}
			}
			out.ActionID = strings.Join(ids, ",")
			return out, &ShardError{Shard: a.shards[i].name, Err: fmt.Errorf("commit of the %s failed; the shards before it committed theirs: %w", action, err)}
		}
		ids = append(ids, a.shards[i].name+"/"+p.res.ActionID)
	}
	slices.Sort(out.Keys)
	out.Keys = out.Keys[:min(len(out.Keys), PlanKeys)]
	out.ActionID = strings.Join(ids, ",")
	if !act.DryRun {
		a.cfg.Logger.LogAttrs(ctx, slog.LevelWarn, "idem: failure group "+action,
			slog.String("group", act.ID), slog.Int64("rows", out.Rows), slog.Any("shards", out.Shards),
			slog.Time("through", act.Through), slog.String("who", out.Who), slog.String("why", out.Why))
	}
	return out, nil
}

// withDB is a copy of a shard's Admin that runs on db (a transaction), quiet: the
// caller logs what committed.
func (a *Admin) withDB(db DB) *Admin {
	c := &Admin{db: db, cfg: a.cfg, q: a.q, name: a.name}
	c.cfg.Logger = slog.New(slog.DiscardHandler)
	return c
}

// shardedActivity sums the shards' activity minute by minute (the latest Now, the
// oldest pending age of any shard); a shard that does not answer fails it.
func (a *Admin) shardedActivity(ctx context.Context, window time.Duration) (*Activity, error) {
	res, errs := fan(ctx, a, func(ctx context.Context, s *Admin) (*Activity, error) { return s.Activity(ctx, window) })
	if err := shardErrors(a.names(), errs); err != nil {
		return nil, err
	}
	out := &Activity{}
	byMinute := map[time.Time]*ActivityMinute{}
	for _, r := range res {
		out.Now = maxTime(out.Now, r.Now)
		for _, m := range r.Minutes {
			at := m.At.UTC()
			x := byMinute[at]
			if x == nil {
				x = &ActivityMinute{At: m.At}
				byMinute[at] = x
			}
			x.Completed += m.Completed
			x.Failed += m.Failed
			x.Sent += m.Sent
			x.Dead += m.Dead
			x.Pending += m.Pending
			x.OldestPendingSeconds = max(x.OldestPendingSeconds, m.OldestPendingSeconds)
		}
	}
	for _, m := range byMinute {
		out.Minutes = append(out.Minutes, *m)
	}
	slices.SortFunc(out.Minutes, func(x, y ActivityMinute) int { return x.At.Compare(y.At) })
	// Shards whose clocks straddle a minute give one more minute: keep the
	// window's length, the newest minutes.
	n := int((window + time.Minute - 1) / time.Minute)
	out.Minutes = out.Minutes[max(0, len(out.Minutes)-n):]
	return out, nil
}

// offRoute refuses an action (ErrOffRoute) when, on some shard, a tenant has rows
// it would change and the map's route names another shard for that tenant. read
// returns, on one shard, the tenants of the rows the action would change there.
func (a *Admin) offRoute(ctx context.Context, what string, read func(ctx context.Context, s *Admin) ([]string, error)) error {
	res, errs := fan(ctx, a, read)
	if err := shardErrors(a.names(), errs); err != nil {
		return err
	}
	for i, tenants := range res {
		for _, tenant := range tenants {
			r, err := a.cfg.Shards.Index(tenant)
			if err != nil {
				return err
			}
			if r != i {
				on, want := a.shards[i].name, a.shards[r].name
				return errorf(ErrOffRoute, "%s: tenant %q has rows it would change on shard %q, but the map routes the tenant to %q; nothing was changed. A tenant move left them there or is not finished: run it (again) with idem shard move-tenant --tenant %s --from %s --to %s, route the tenant to %s, then run this again",
					what, tenant, on, want, quoteArg(tenant), on, want, want)
			}
		}
	}
	return nil
}

// quoteArg quotes s for a shell command line when it needs it.
func quoteArg(s string) string {
	if s != "" && strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:/@") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// tenantsOf runs a statement that returns the tenants of the rows an action would
// change on one shard.
func (a *Admin) tenantsOf(ctx context.Context, sql string, args ...any) ([]string, error) {
	rows, err := a.db.Query(ctx, sql, args...)
	if err != nil {
		return nil, a.wrap(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	return out, a.wrap(err)
}

// table is the quoted name of one of idem's tables in the Admin's schema.
func (a *Admin) table(name string) string { return pgx.Identifier{a.cfg.Schema, name}.Sanitize() }
