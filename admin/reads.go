package admin

import (
	"cmp"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/fanout"
	"github.com/idemkit/idem/internal/text"
)

// Page asks for one page of a list.
type Page struct {
	// Limit is the most rows returned (DefaultLimit when 0, at most MaxLimit).
	Limit int
	// After is the Next of the previous page; empty for the first page.
	After string
}

func (p Page) limit() (int, error) {
	switch {
	case p.Limit == 0:
		return DefaultLimit, nil
	case p.Limit < 0 || p.Limit > MaxLimit:
		return 0, errorf(ErrBadFilter, "page limit %d: use 1 to %d", p.Limit, MaxLimit)
	}
	return p.Limit, nil
}

// List is one page of a list: its rows, and the cursor of the next page.
type List[T any] struct {
	Rows []T `json:"rows"`
	// Next is the cursor of the next page (its Page.After), empty on the last one.
	Next string `json:"next,omitempty"`
}

// A cursor is the primary key of the last row of a page, with the list's name, as
// base64url of a JSON array. It holds no filter: a cursor used with other filters
// still pages correctly through the rows after that key.
func encodeCursor(list string, pk ...string) string {
	b, _ := json.Marshal(append([]string{list}, pk...))
	return base64.RawURLEncoding.EncodeToString(b)
}

func decodeCursor(list, c string) ([]string, error) {
	if c == "" {
		return []string{"", "", ""}, nil
	}
	b, err := base64.RawURLEncoding.DecodeString(c)
	var parts []string
	if err == nil {
		err = json.Unmarshal(b, &parts)
	}
	if err != nil || len(parts) != 4 || parts[0] != list {
		return nil, errorf(ErrBadCursor, "page cursor %q is not one that the %s list returned", text.Clip(c, 40), list)
	}
	return parts[1:], nil
}

// TimeRange keeps rows whose time is in [Since, Until); a zero end is open.
type TimeRange struct {
	Since, Until time.Time
}

func (r TimeRange) args() (since, until *time.Time) {
	if !r.Since.IsZero() {
		since = &r.Since
	}
	if !r.Until.IsZero() {
		until = &r.Until
	}
	return since, until
}

// InboxFilter picks inbox keys; zero fields do not filter.
type InboxFilter struct {
	Consumer string
	// Tenant, when not nil, keeps that tenant's keys ("" is the unscoped ones).
	Tenant *string
	// State is completed, failed or processing.
	State     string
	KeyPrefix string
	// Received filters on received_at.
	Received TimeRange
}

var inboxStates = []string{"", string(inbox.StateCompleted), string(inbox.StateFailed), string(inbox.StateProcessing)}

// ListInbox returns one page of the inbox keys that f picks, in primary key order.
// Paging is by keyset: a key inserted or deleted between two pages never makes
// another key appear twice or go missing.
//
// Over a shard map the shards' pages merge in the same order, with a cursor that
// carries each shard's position, and each key names its shard.
func (a *Admin) ListInbox(ctx context.Context, f InboxFilter, p Page) (*List[InboxKey], error) {
	if !slices.Contains(inboxStates, f.State) {
		return nil, errorf(ErrBadFilter, "inbox state %q: use completed, failed or processing", f.State)
	}
	limit, err := p.limit()
	if err != nil {
		return nil, err
	}
	keys, next, err := fanout.List[*part, InboxKey]{
		Name: "inbox",
		Fetch: func(_ int, p *part, limit int, after string) ([]InboxKey, string, error) {
			return p.listInbox(ctx, f, limit, after)
		},
		Order: func(x, y InboxKey) int {
			return cmp.Or(cmp.Compare(x.Consumer, y.Consumer), cmp.Compare(x.Tenant, y.Tenant), cmp.Compare(x.Key, y.Key))
		},
		Cursor:    func(k InboxKey) string { return encodeCursor("inbox", k.Consumer, k.Tenant, k.Key) },
		BadCursor: badCursor, Join: a.join,
	}.Page(a.parts, p.After, limit)
	if err != nil {
		return nil, err
	}
	return &List[InboxKey]{Rows: keys, Next: next}, nil
}

// listInbox reads a page of at most limit keys after the cursor after, and the
// cursor of the next page.
func (a *part) listInbox(ctx context.Context, f InboxFilter, limit int, c string) ([]InboxKey, string, error) {
	after, err := decodeCursor("inbox", c)
	if err != nil {
		return nil, "", err
	}
	since, until := f.Received.args()
	var keys []InboxKey
	keys, err = collectInboxKeys(a.db.Query(ctx, a.q.listInbox, f.Consumer, f.Tenant, f.State, f.KeyPrefix,
		since, until, after[0], after[1], after[2], limit+1))
	err = a.wrap(err)
	if err != nil {
		return nil, "", err
	}
	for i := range keys {
		keys[i].Shard = a.name
	}
	if len(keys) > limit {
		last := keys[limit-1]
		return keys[:limit], encodeCursor("inbox", last.Consumer, last.Tenant, last.Key), nil
	}
	return nonNil(keys), "", nil
}

// EffectFilter picks effects; zero fields do not filter.
type EffectFilter struct {
	// Tenant, when not nil, keeps that tenant's effects ("" is the unscoped ones).
	Tenant *string
	Kind   string
	// State is pending, done, dead or discarded.
	State string
	// Stuck keeps the pending effects that look stuck (Effect.Stuck).
	Stuck     bool
	KeyPrefix string
	// Consumer keeps the effects made by that consumer's messages (or that HTTP
	// operation's requests).
	Consumer string
	// Created filters on created_at.
	Created TimeRange
}

var effectStates = []string{"", "pending", "done", "dead", "discarded"}

// ListEffects returns one page of the effects that f picks, in primary key order,
// paged by keyset like ListInbox.
func (a *Admin) ListEffects(ctx context.Context, f EffectFilter, p Page) (*List[Effect], error) {
	if !slices.Contains(effectStates, f.State) {
		return nil, errorf(ErrBadFilter, "effect state %q: use pending, done, dead or discarded", f.State)
	}
	if f.Stuck && f.State != "" && f.State != "pending" {
		return nil, errorf(ErrBadFilter, "stuck effects are pending ones, not %s", f.State)
	}
	limit, err := p.limit()
	if err != nil {
		return nil, err
	}
	effs, next, err := fanout.List[*part, Effect]{
		Name: "effects",
		Fetch: func(_ int, p *part, limit int, after string) ([]Effect, string, error) {
			return p.listEffects(ctx, f, limit, after)
		},
		Order: func(x, y Effect) int {
			return cmp.Or(cmp.Compare(x.Tenant, y.Tenant), cmp.Compare(x.Kind, y.Kind), cmp.Compare(x.Key, y.Key))
		},
		Cursor:    func(e Effect) string { return encodeCursor("effects", e.Tenant, e.Kind, e.Key) },
		BadCursor: badCursor, Join: a.join,
	}.Page(a.parts, p.After, limit)
	if err != nil {
		return nil, err
	}
	return &List[Effect]{Rows: effs, Next: next}, nil
}

func (a *part) listEffects(ctx context.Context, f EffectFilter, limit int, c string) ([]Effect, string, error) {
	after, err := decodeCursor("effects", c)
	if err != nil {
		return nil, "", err
	}
	since, until := f.Created.args()
	effs, err := a.collectEffects(a.db.Query(ctx, a.q.listEffects, f.Tenant, f.Kind, f.State, f.KeyPrefix, f.Consumer,
		since, until, f.Stuck, a.cfg.StuckAfter, a.cfg.StuckAttempts, after[0], after[1], after[2], limit+1))
	if err != nil {
		return nil, "", err
	}
	if len(effs) > limit {
		last := effs[limit-1]
		return effs[:limit], encodeCursor("effects", last.Tenant, last.Kind, last.Key), nil
	}
	return nonNil(effs), "", nil
}

// InspectOptions tune InspectInbox.
type InspectOptions struct {
	// Body includes a stored HTTP response's body. It may hold personal data: leave
	// it out unless the operator asked for it.
	Body bool
}

// Inspection is one inbox key and the effects its message or request made.
type Inspection struct {
	InboxKey
	// Effects made by the key's message or request, oldest first.
	Effects []Effect `json:"effects"`
}

// InspectInbox reads one inbox key, its stored HTTP response if it has one, and the
// effects that its message or request made. A missing key is ErrNotFound.
// Over a shard map the key is looked up on every shard (its tenant's first), so
// that it is found wherever the route put it.
func (a *Admin) InspectInbox(ctx context.Context, id inbox.ID, o InspectOptions) (*Inspection, error) {
	if err := id.Validate(); err != nil {
		return nil, err
	}
	return lookup(a, id.Tenant, func(p *part) (*Inspection, error) { return p.inspectInbox(ctx, id, o) })
}

func (a *part) inspectInbox(ctx context.Context, id inbox.ID, o InspectOptions) (*Inspection, error) {
	var key *InboxKey
	var body []byte
	key, err := scanInboxKey(a.db.QueryRow(ctx, a.q.getInbox, id.Consumer, id.Tenant, id.Key), &body)
	err = a.wrap(err)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, errorf(ErrNotFound, "no inbox key %s", formatID(id))
	}
	if err != nil {
		return nil, err
	}
	out := &Inspection{InboxKey: *key}
	if out.Response != nil && o.Body {
		out.Response.Body = body
	}
	effs, err := a.collectEffects(a.db.Query(ctx, a.q.effectsBySource, id.Consumer, id.Tenant, id.Key))
	if err != nil {
		return nil, err
	}
	out.Effects = nonNil(effs)
	out.Shard = a.name
	return out, nil
}

// InspectEffect reads one effect; a missing one is ErrNotFound.
// Over a shard map it is looked up on every shard, as InspectInbox's key is.
func (a *Admin) InspectEffect(ctx context.Context, id EffectID) (*Effect, error) {
	return lookup(a, id.Tenant, func(p *part) (*Effect, error) { return p.inspectEffect(ctx, id) })
}

func (a *part) inspectEffect(ctx context.Context, id EffectID) (*Effect, error) {
	e, err := a.scanEffect(a.db.QueryRow(ctx, a.q.getEffect, id.Tenant, id.Kind, id.Key))
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, errorf(ErrNotFound, "no effect %s", id)
	}
	if err != nil {
		return nil, a.wrap(err)
	}
	return e, nil
}

// lookup reads one row with read on every part and returns the row of the first
// part (the tenant's routed part first, then map order) that has it. ErrNotFound
// is returned only when every part answered and none has it; otherwise the
// parts' errors.
func lookup[R any](a *Admin, tenant string, read func(p *part) (R, error)) (R, error) {
	r, at, errs, miss := fanout.Lookup(a.parts, tenant, func(_ int, p *part) (R, error) { return read(p) },
		func(err error) bool { return errors.Is(err, ErrNotFound) })
	if at >= 0 {
		return r, nil
	}
	if err := a.join(errs); err != nil {
		return r, err
	}
	return r, miss
}

// Found is what Find found under one key.
type Found struct {
	Key     string     `json:"key"`
	Inbox   []InboxKey `json:"inbox"`
	Effects []Effect   `json:"effects"`
}

// FindFilter narrows Find.
type FindFilter struct {
	// Tenant, when not nil, keeps that tenant's rows.
	Tenant *string
	// Kind keeps the effects of that kind.
	Kind string
}

// Find looks key up across the whole schema: the inbox keys of every consumer
// (messages and HTTP operations) and the effects of every kind with that key, at
// most FindLimit of each. It probes the primary keys once per distinct (consumer,
// tenant) and (tenant, kind) pair, so it does not scan the tables. Over a shard
// map each shard's rows name it, in the same order.
func (a *Admin) Find(ctx context.Context, key string, f FindFilter) (*Found, error) {
	if key == "" {
		return nil, errorf(ErrBadFilter, "find needs a key")
	}
	res, errs := fanout.Collect(a.parts, func(_ int, p *part) (*Found, error) { return p.find(ctx, key, f) })
	if err := a.join(errs); err != nil {
		return nil, err
	}
	out := &Found{Key: key, Inbox: []InboxKey{}, Effects: []Effect{}}
	for _, r := range res {
		out.Inbox = append(out.Inbox, r.Inbox...)
		out.Effects = append(out.Effects, r.Effects...)
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

func (a *part) find(ctx context.Context, key string, f FindFilter) (*Found, error) {
	out := &Found{Key: key}
	citus, err := a.onCitus(ctx)
	if err != nil {
		return nil, err
	}
	findInbox, findEffects := a.q.findInbox, a.q.findEffects
	if citus {
		findInbox, findEffects = a.q.findInboxCitus, a.q.findEffectsCitus
	}
	out.Inbox, err = collectInboxKeys(a.db.Query(ctx, findInbox, key, f.Tenant, FindLimit))
	err = a.wrap(err)
	if err != nil {
		return nil, err
	}
	out.Effects, err = a.collectEffects(a.db.Query(ctx, findEffects, key, f.Tenant, f.Kind, FindLimit))
	if err != nil {
		return nil, err
	}
	for i := range out.Inbox {
		out.Inbox[i].Shard = a.name
	}
	return out, nil
}

func nonNil[T any](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}
