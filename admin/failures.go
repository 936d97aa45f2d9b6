package admin

import (
	"cmp"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/idem/internal/failgroup"
	"github.com/idemkit/idem/internal/fanout"
	"github.com/idemkit/idem/internal/text"
)

// Failure groups: their sources, their orders and the repair actions on them.
const (
	// SourceInbox groups failed inbox keys, by consumer and tenant.
	SourceInbox = "inbox"
	// SourceEffects groups dead effects, by kind and tenant.
	SourceEffects = "effects"

	// ByCount lists the largest groups first.
	ByCount = "count"
	// ByRecent lists the groups with the most recent failure first.
	ByRecent = "recent"

	// ActionRetry brings a group's dead effects back to pending, attempts from 0.
	ActionRetry = "retry"
	// ActionDiscard settles a group's dead effects as discarded: never sent, and
	// deleted by the janitor after the retention of done effects.
	ActionDiscard = "discard"
	// ActionRelease deletes a group's failed inbox keys, so that the next delivery
	// of each (a redelivery, or a republish) runs its handler again.
	ActionRelease = "release"
)

// actions are the repair actions, in the order the metrics list them.
var actions = []string{ActionRetry, ActionDiscard, ActionRelease}

// FailureGroup is the failures of one consumer (or effect kind) and tenant that
// share an error code and a masked error text: most likely one cause.
type FailureGroup struct {
	// ID is stable: the same failures make the same group, in every process and
	// after a restart. "i-" and 16 hex digits for an inbox group, "e-" for effects.
	ID     string `json:"id"`
	Source string `json:"source"`
	// Consumer is an inbox group's consumer (or HTTP operation); Kind an effects
	// group's kind.
	Consumer string `json:"consumer,omitempty"`
	Kind     string `json:"kind,omitempty"`
	Tenant   string `json:"tenant"`
	Code     string `json:"code"`
	// Masked is the error text with its variable parts masked (numbers, UUIDs,
	// quoted values, hex), the same for every failure of the group.
	Masked string `json:"masked_error"`
	// Example is the whole error text of the group's most recent failure.
	Example string `json:"example_error"`
	// Count is how many failures the group holds (in the time range asked for).
	Count int64 `json:"count"`
	// FirstSeen and LastSeen are when its oldest and newest failure happened. Pass
	// LastSeen as an action's Through, so that the action touches no failure that
	// arrived after this read.
	FirstSeen time.Time `json:"first_seen"`
	LastSeen  time.Time `json:"last_seen"`
	// SampleKeys are a few of its keys (inbox keys, or effect keys), newest first.
	SampleKeys []string `json:"sample_keys"`
	// Attempts is an effects group's distribution of attempts made (Group only):
	// how many of its dead effects made that many attempts, by attempts.
	Attempts []struct {
		Attempts int   `json:"attempts"`
		Effects  int64 `json:"effects"`
	} `json:"attempts,omitempty"`
	// Actions are the repair actions taken on the group so far, newest first
	// (Group only).
	Actions []FailureAction `json:"actions,omitempty"`
	// Shard names every shard that holds some of the group's failures,
	// comma-separated in map order (an Admin over a shard map).
	Shard string `json:"shard,omitempty"`
	// Parts are each of those shards' part of the group, in map order (an Admin
	// over a shard map): Count, FirstSeen and LastSeen above are their sum,
	// earliest and latest.
	Parts []struct {
		Shard     string    `json:"shard"`
		Count     int64     `json:"count"`
		FirstSeen time.Time `json:"first_seen"`
		LastSeen  time.Time `json:"last_seen"`
	} `json:"parts,omitempty"`
}

// attemptsCount and groupPart are the types of FailureGroup.Attempts and Parts.
type (
	attemptsCount = struct {
		Attempts int   `json:"attempts"`
		Effects  int64 `json:"effects"`
	}
	groupPart = struct {
		Shard     string    `json:"shard"`
		Count     int64     `json:"count"`
		FirstSeen time.Time `json:"first_seen"`
		LastSeen  time.Time `json:"last_seen"`
	}
)

// add appends a zero element to s and returns s and the element (for slices of
// an unnamed struct type).
func add[T any](s []T) ([]T, *T) {
	s = append(s, *new(T))
	return s, &s[len(s)-1]
}

// Place is the group's consumer or kind.
func (g *FailureGroup) Place() string { return cmp.Or(g.Consumer, g.Kind) }

// GroupFilter picks failure groups; zero fields do not filter.
type GroupFilter struct {
	// Source is SourceInbox or SourceEffects; "" lists both.
	Source string
	// Consumer keeps that consumer's inbox groups, Kind that kind's effects groups.
	// Naming only one of them lists only its source.
	Consumer string
	Kind     string
	// Tenant, when not nil, keeps that tenant's groups ("" is the unscoped ones).
	Tenant *string
	// Code keeps the groups of that error code, matched exactly ("" keeps every
	// code): a failure's code, such as payment_declined, is part of its group. A
	// code that no failure can have been stored with (invalid UTF-8, a NUL byte) is
	// ErrBadFilter.
	Code string
	// Seen counts only the failures that happened in the range: a group with none
	// there is left out.
	Seen TimeRange
	// Order is ByCount (the default) or ByRecent. Ties go by ID.
	Order string
}

// groupID is a parsed FailureGroup.ID.
type groupID struct {
	source string
	hash   []byte
}

func (g groupID) String() string { return g.source[:1] + "-" + hex.EncodeToString(g.hash) }

func formatGroupID(source string, hash []byte) string { return groupID{source, hash}.String() }

func parseGroupID(id string) (groupID, error) {
	var g groupID
	switch {
	case strings.HasPrefix(id, "i-"):
		g.source = SourceInbox
	case strings.HasPrefix(id, "e-"):
		g.source = SourceEffects
	}
	h, err := hex.DecodeString(id[min(len(id), 2):])
	if g.source == "" || err != nil || len(h) != 8 {
		return g, errorf(ErrBadFilter, "failure group ID %q: want i- or e- and 16 hex digits, as the list of groups shows", clip(id))
	}
	g.hash = h
	return g, nil
}

func clip(s string) string {
	if len(s) > 40 {
		return s[:40] + "…"
	}
	return s
}

// ListGroups returns one page of the failure groups that f picks: failed inbox keys
// by consumer, tenant, code and masked text, and dead effects by kind, tenant, code
// and masked text. Each group carries its counts, first and last seen, a few sample
// keys, its masked text and one full example. Paging is by keyset over the order
// (count or recency, then ID); a group whose count changes between two pages may
// move across the cursor, never appear twice on one page.
//
// Failures recorded before the schema had failure groups (migration 006) are put
// in their groups first, in batches, if the API's role may update them.
//
// Over a shard map a group whose failures are on several shards is one row (see
// mergeGroups).
func (a *Admin) ListGroups(ctx context.Context, f GroupFilter, p Page) (*List[FailureGroup], error) {
	gp, err := f.paging(p)
	if err != nil {
		return nil, err
	}
	return fanout.Whole(a.parts, func(one *part) (*List[FailureGroup], error) {
		// Citus refuses the one statement's join of the groups with their
		// samples: the groups are read and paged as over a shard map, and each
		// group of the page reads its samples on its tenant's shard.
		citus, err := one.onCitus(ctx)
		if err != nil {
			return nil, err
		}
		if citus {
			return a.mergeGroups(ctx, f, p, gp)
		}
		return one.listGroups(ctx, f, gp, p.After != "")
	}, func() (*List[FailureGroup], error) { return a.mergeGroups(ctx, f, p, gp) })
}

// listGroups is ListGroups on one database: one statement, that reads a page of
// groups with their samples.
func (a *part) listGroups(ctx context.Context, f GroupFilter, gp groupPaging, after bool) (*List[FailureGroup], error) {
	limit := gp.limit
	groups, err := a.groups(ctx, f, gp, after, limit+1)
	if err != nil {
		return nil, err
	}
	out := &List[FailureGroup]{Rows: groups}
	if len(groups) > limit {
		out.Rows = groups[:limit]
		out.Next = encodeGroupCursor(groups[limit-1], gp.order)
	}
	return out, nil
}

// groups reads, on one database, the groups that f picks in gp's order, after
// gp's cursor when after is set, at most limit of them, with one aggregate of
// the failures.
func (a *part) groups(ctx context.Context, f GroupFilter, gp groupPaging, after bool, limit int) ([]FailureGroup, error) {
	if err := a.backfill(ctx, gp.inbox, gp.effects); err != nil {
		return nil, err
	}
	since, until := f.Seen.args()
	rows, err := a.db.Query(ctx, a.q.listGroups, gp.inbox, gp.effects, f.Consumer, f.Kind, f.Tenant, since, until,
		gp.order == ByRecent, after, gp.afterValue, gp.afterID, limit, ListSamples, f.Code)
	if err != nil {
		return nil, a.wrap(err)
	}
	groups, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (FailureGroup, error) { return scanGroup(r) })
	if err != nil {
		return nil, a.wrap(err)
	}
	return nonNil(groups), nil
}

// groupCounts reads, on one database, every group that f picks, with one
// aggregate of the failures: their counts and times, without code, texts or
// sample keys (sampleGroups reads those for the groups a page shows).
func (a *part) groupCounts(ctx context.Context, f GroupFilter, gp groupPaging) ([]FailureGroup, error) {
	if err := a.backfill(ctx, gp.inbox, gp.effects); err != nil {
		return nil, err
	}
	since, until := f.Seen.args()
	rows, err := a.db.Query(ctx, a.q.groupCounts, gp.inbox, gp.effects, f.Consumer, f.Kind, f.Tenant, since, until, f.Code)
	if err != nil {
		return nil, a.wrap(err)
	}
	groups, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (FailureGroup, error) {
		var g FailureGroup
		var hash []byte
		var place string
		if err := r.Scan(&g.Source, &hash, &place, &g.Tenant, &g.Count, &g.FirstSeen, &g.LastSeen); err != nil {
			return g, err
		}
		g.setPlace(hash, place)
		g.SampleKeys = []string{}
		g.Shard = a.name
		return g, nil
	})
	if err != nil {
		return nil, a.wrap(err)
	}
	return groups, nil
}

// sampleGroups reads, on one database and with one statement (on Citus, one a
// group), the code, texts and newest n sample keys (of the failures in seen) of
// each of groups, as groupCounts read them there.
func (a *part) sampleGroups(ctx context.Context, groups []*FailureGroup, seen TimeRange, n int) error {
	sources, hashes, places, tenants := make([]string, len(groups)), make([][]byte, len(groups)), make([]string, len(groups)), make([]string, len(groups))
	for i, g := range groups {
		id, err := parseGroupID(g.ID)
		if err != nil {
			return err
		}
		sources[i], hashes[i], places[i], tenants[i] = g.Source, id.hash, g.Place(), g.Tenant
	}
	since, until := seen.args()
	citus, err := a.onCitus(ctx)
	if err != nil {
		return err
	}
	if citus {
		// One statement a group, routed to its tenant's shard.
		for i, g := range groups {
			err := a.db.QueryRow(ctx, a.q.groupSampleCitus, sources[i], hashes[i], places[i], tenants[i], since, until, n).
				Scan(&g.Code, &g.Masked, &g.Example, &g.SampleKeys)
			if err != nil {
				return a.wrap(err)
			}
			g.SampleKeys = nonNil(g.SampleKeys)
		}
		return nil
	}
	rows, err := a.db.Query(ctx, a.q.groupSamples, sources, hashes, places, tenants, since, until, n)
	if err != nil {
		return a.wrap(err)
	}
	defer rows.Close()
	// One row a group, in their order.
	for i := 0; rows.Next(); i++ {
		g := groups[i]
		if err := rows.Scan(&g.Code, &g.Masked, &g.Example, &g.SampleKeys); err != nil {
			return a.wrap(err)
		}
		g.SampleKeys = nonNil(g.SampleKeys)
	}
	return a.wrap(rows.Err())
}

// groupPaging is a page of failure groups as ListGroups asks for it, checked.
type groupPaging struct {
	inbox, effects bool // the sources
	order          string
	limit          int
	// afterValue and afterID are the cursor's position: -1 and "" for none.
	afterValue int64
	afterID    string
}

// paging checks f and p for ListGroups: the source, the code, the order, the limit
// and the cursor. Each refusal is coded bad_filter or bad_cursor.
func (f GroupFilter) paging(p Page) (groupPaging, error) {
	var gp groupPaging
	var err error
	if gp.inbox, gp.effects, err = f.sources(); err != nil {
		return gp, err
	}
	tenant := ""
	if f.Tenant != nil {
		tenant = *f.Tenant
	}
	for _, v := range []struct{ name, value string }{
		{"consumer", f.Consumer}, {"kind", f.Kind}, {"tenant", tenant}, {"error code", f.Code},
	} {
		if !text.Storable(v.value) {
			// Postgres text never holds these, so no failure has such a value.
			return gp, errorf(ErrBadFilter, "%s %q: not valid UTF-8 text without NUL bytes, so no failure has it", v.name, clip(v.value))
		}
	}
	gp.order = cmp.Or(f.Order, ByCount)
	if gp.order != ByCount && gp.order != ByRecent {
		return gp, errorf(ErrBadFilter, "group order %q: use %s or %s", f.Order, ByCount, ByRecent)
	}
	if gp.limit, err = p.limit(); err != nil {
		return gp, err
	}
	gp.afterValue, gp.afterID, err = decodeGroupCursor(p.After, gp.order)
	return gp, err
}

// groupValue is what a list of groups in order is sorted by, largest first: the
// count, or the last failure's time in microseconds.
func groupValue(g FailureGroup, order string) int64 {
	if order == ByRecent {
		return g.LastSeen.UnixMicro()
	}
	return g.Count
}

// A groups cursor is the order, the last group's value and its ID.
func encodeGroupCursor(last FailureGroup, order string) string {
	return encodeCursor("groups", order, fmt.Sprint(groupValue(last, order)), last.ID)
}

// decodeGroupCursor returns the position of a groups cursor of order: -1 and ""
// for none.
func decodeGroupCursor(c, order string) (int64, string, error) {
	if c == "" {
		return -1, "", nil
	}
	after, err := decodeCursor("groups", c)
	if err != nil {
		return 0, "", err
	}
	if after[0] != order {
		return 0, "", errorf(ErrBadCursor, "page cursor of the %s order used with the %s order", after[0], order)
	}
	var v int64
	if _, err := fmt.Sscan(after[1], &v); err != nil {
		return 0, "", errorf(ErrBadCursor, "page cursor %q is not one that the groups list returned", clip(c))
	}
	return v, after[2], nil
}

func (f GroupFilter) sources() (inboxOn, effectsOn bool, err error) {
	switch f.Source {
	case "", SourceInbox, SourceEffects:
	default:
		return false, false, errorf(ErrBadFilter, "failure source %q: use %s or %s", f.Source, SourceInbox, SourceEffects)
	}
	inboxOn = f.Source != SourceEffects && (f.Kind == "" || f.Consumer != "")
	effectsOn = f.Source != SourceInbox && (f.Consumer == "" || f.Kind != "")
	if !inboxOn && !effectsOn {
		return false, false, errorf(ErrBadFilter, "a consumer filters inbox groups, a kind effects groups: source %s lists neither", f.Source)
	}
	return inboxOn, effectsOn, nil
}

func scanGroup(r pgx.Row) (FailureGroup, error) {
	var g FailureGroup
	var hash []byte
	var place string
	err := r.Scan(&g.Source, &hash, &place, &g.Tenant, &g.Count, &g.FirstSeen, &g.LastSeen,
		&g.Code, &g.Masked, &g.Example, &g.SampleKeys)
	if err != nil {
		return g, err
	}
	g.setPlace(hash, place)
	g.SampleKeys = nonNil(g.SampleKeys)
	return g, nil
}

// setPlace sets the ID of the group of Source with hash, and its consumer or kind.
func (g *FailureGroup) setPlace(hash []byte, place string) {
	g.ID = formatGroupID(g.Source, hash)
	if g.Source == SourceInbox {
		g.Consumer = place
	} else {
		g.Kind = place
	}
}

// Group reads one failure group by ID: what a list shows, with more sample keys,
// for effects the distribution of attempts, and the repair actions taken on it.
// seen counts only the failures in that range, as GroupFilter.Seen does. A group
// that holds no failure (in the range) is ErrNotFound; its actions stay readable
// with ListActions.
//
// Over a shard map the group's parts on every shard are merged (see mergeGroup),
// with each shard's part in Parts, and its actions are those of every shard.
func (a *Admin) Group(ctx context.Context, id string, seen TimeRange) (*FailureGroup, error) {
	if _, err := parseGroupID(id); err != nil {
		return nil, err
	}
	res, errs := fanout.Collect(a.parts, func(_ int, p *part) (*FailureGroup, error) { return p.group(ctx, id, seen) })
	var parts []*FailureGroup
	var notFound error
	attempts := map[int]int64{}
	for i, g := range res {
		if errors.Is(errs[i], ErrNotFound) {
			notFound = cmp.Or(notFound, errs[i])
			errs[i] = nil
			continue
		}
		if errs[i] != nil {
			continue
		}
		parts = append(parts, g)
		for _, at := range g.Attempts {
			attempts[at.Attempts] += at.Effects
		}
	}
	if err := a.join(errs); err != nil {
		return nil, err
	}
	if parts == nil {
		return nil, notFound
	}
	out := mergeGroup(parts, GroupSamples)
	for _, n := range slices.Sorted(maps.Keys(attempts)) {
		var at *attemptsCount
		out.Attempts, at = add(out.Attempts)
		at.Attempts, at.Effects = n, attempts[n]
	}
	acts, err := a.ListActions(ctx, ActionFilter{Group: id}, Page{Limit: 20})
	if err != nil {
		return nil, err
	}
	out.Actions = acts.Rows
	return out, nil
}

// group is Group on one database without the actions (a shard map's Group reads
// them from every shard, merged, once).
func (a *part) group(ctx context.Context, id string, seen TimeRange) (*FailureGroup, error) {
	g, err := parseGroupID(id)
	if err != nil {
		return nil, err
	}
	if err := a.backfill(ctx, g.source == SourceInbox, g.source == SourceEffects); err != nil {
		return nil, err
	}
	since, until := seen.args()
	out, err := scanGroup(a.db.QueryRow(ctx, a.q.getGroup, g.source == SourceInbox, g.hash, since, until, GroupSamples))
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, errorf(ErrNotFound, "no failures in group %s (released, retried or discarded, or never there)", id)
	}
	if err != nil {
		return nil, a.wrap(err)
	}
	out.Shard = a.name
	if g.source == SourceEffects {
		rows, err := a.db.Query(ctx, a.q.groupAttempts, g.hash, since, until)
		if err != nil {
			return nil, a.wrap(err)
		}
		out.Attempts, err = pgx.CollectRows(rows, pgx.RowToStructByPos[attemptsCount])
		if err != nil {
			return nil, a.wrap(err)
		}
	}
	return &out, nil
}

// backfillBatch is how many old failures one backfill statement groups.
const backfillBatch = 1000

// backfill puts the failed inbox keys and dead effects that have no failure group
// yet (recorded before migration 006) in their groups: it reads a batch of them
// from the NULL end of the group index (one index probe when there are none),
// masks their errors with the
// same function the writers use, and writes the group back, one short statement
// per batch, until none is left. It is idempotent and safe to run in several
// processes at once (a row that another run grouped first is left alone). A role
// that may not update the tables leaves them out of the groups, and the lists go on.
func (a *part) backfill(ctx context.Context, inboxOn, effectsOn bool) error {
	for _, on := range []struct {
		on          bool
		read, write string
	}{{inboxOn, a.q.ungroupedInbox, a.q.groupInbox}, {effectsOn, a.q.ungroupedEffects, a.q.groupEffects}} {
		// The first read is a probe of one row: nearly always there is nothing to do.
		for limit := 1; on.on; limit = backfillBatch {
			rows, err := a.db.Query(ctx, on.read, limit)
			if err != nil {
				return a.wrap(err)
			}
			var aa, bb, cc, errs []string
			var x, y, z, e string
			var ungrouped bool
			_, err = pgx.ForEachRow(rows, []any{&x, &y, &z, &e, &ungrouped}, func() error {
				if ungrouped {
					aa, bb, cc, errs = append(aa, x), append(bb, y), append(cc, z), append(errs, e)
				}
				return nil
			})
			if err != nil {
				return a.wrap(err)
			}
			if len(aa) == 0 {
				break
			}
			masked := make([]string, len(errs))
			for i, e := range errs {
				masked[i] = failgroup.Mask(e)
			}
			tag, err := a.db.Exec(ctx, on.write, aa, bb, cc, errs, masked)
			if err != nil {
				var pgErr *pgconn.PgError
				if errors.As(err, &pgErr) && slices.Contains([]string{"42501", "25006"}, pgErr.Code) {
					break // insufficient privilege, or a read-only transaction
				}
				return a.wrap(err)
			}
			if len(aa) < limit && limit > 1 || tag.RowsAffected() == 0 {
				break // the last batch, or rows that changed under us: the next read takes them
			}
		}
	}
	return nil
}
