package admin

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/text"
)

// Stats is the state of one schema's tables.
type Stats struct {
	Schema    string          `json:"schema"`
	Consumers []ConsumerStats `json:"consumers"`
	Effects   []KindStats     `json:"effects"`
	// Shards are each shard's own figures, and which shard did not answer (an
	// Admin over a shard map; the figures above are their sums).
	Shards []ShardStats `json:"shards,omitempty"`
}

// ConsumerStats counts one consumer's inbox rows by state.
type ConsumerStats struct {
	Consumer   string `json:"consumer"`
	Rows       int64  `json:"rows"`
	Completed  int64  `json:"completed"`
	Failed     int64  `json:"failed"`
	Processing int64  `json:"processing"`
	// Expired rows are settled and past expires_at: the janitor's next work.
	Expired int64 `json:"expired"`
	// Oldest is when the oldest row was received.
	Oldest *time.Time `json:"oldest_received_at,omitempty"`
	// OldestProcessingSeconds is the age of the oldest processing row (lease mode),
	// in seconds; 0 when none.
	OldestProcessingSeconds float64 `json:"oldest_processing_age_seconds"`
}

// KindStats counts one effect kind's rows by state.
type KindStats struct {
	Kind    string `json:"kind"`
	Pending int64  `json:"pending"`
	// Due are pending effects whose due time has come.
	Due  int64 `json:"due"`
	Dead int64 `json:"dead"`
	Done int64 `json:"done"`
	// Discarded are dead effects an operator discarded (DiscardGroup): never
	// sent, deleted by the janitor after the retention.
	Discarded int64 `json:"discarded"`
	// InFlight are pending effects claimed by a dispatcher, outcome not recorded yet.
	InFlight int64 `json:"in_flight"`
	// Stuck are pending effects that look stuck (see Effect.Stuck).
	Stuck int64 `json:"stuck"`
	// OldestPendingSeconds is the age of the oldest pending effect, in seconds
	// (0 when none is pending).
	OldestPendingSeconds float64 `json:"oldest_pending_age_seconds"`
}

// OldestPendingAge is OldestPendingSeconds as a duration.
func (k KindStats) OldestPendingAge() time.Duration {
	return time.Duration(k.OldestPendingSeconds * float64(time.Second))
}

// Stats counts the inbox rows per consumer and state, and the effects per kind and
// state, with the age of the oldest pending one. It scans both tables.
func (a *Admin) Stats(ctx context.Context) (*Stats, error) {
	if a.shards != nil {
		return a.shardedStats(ctx)
	}
	rows, err := a.db.Query(ctx, a.q.consumerStats)
	if err != nil {
		return nil, a.wrap(err)
	}
	cs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (ConsumerStats, error) {
		var s ConsumerStats
		err := r.Scan(&s.Consumer, &s.Rows, &s.Completed, &s.Failed, &s.Processing, &s.Expired, &s.Oldest, &s.OldestProcessingSeconds)
		return s, err
	})
	if err != nil {
		return nil, a.wrap(err)
	}
	rows, err = a.db.Query(ctx, a.q.effectStats, a.cfg.StuckAfter, a.cfg.StuckAttempts)
	if err != nil {
		return nil, a.wrap(err)
	}
	ks, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (KindStats, error) {
		var s KindStats
		err := r.Scan(&s.Kind, &s.Pending, &s.Due, &s.Dead, &s.Done, &s.Discarded, &s.InFlight, &s.Stuck, &s.OldestPendingSeconds)
		return s, err
	})
	if err != nil {
		return nil, a.wrap(err)
	}
	return &Stats{Schema: a.cfg.Schema, Consumers: nonNil(cs), Effects: nonNil(ks)}, nil
}

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

// InboxPage is one page of inbox keys, in primary key order (consumer, tenant,
// key).
type InboxPage struct {
	Keys []InboxKey `json:"keys"`
	// Next is the cursor of the next page, empty on the last one.
	Next string `json:"next,omitempty"`
}

var inboxStates = []string{"", string(inbox.StateCompleted), string(inbox.StateFailed), string(inbox.StateProcessing)}

// ListInbox returns one page of the inbox keys that f picks, in primary key order.
// Paging is by keyset: a key inserted or deleted between two pages never makes
// another key appear twice or go missing.
func (a *Admin) ListInbox(ctx context.Context, f InboxFilter, p Page) (*InboxPage, error) {
	if a.shards != nil {
		return a.shardedListInbox(ctx, f, p)
	}
	if !slices.Contains(inboxStates, f.State) {
		return nil, errorf(ErrBadFilter, "inbox state %q: use completed, failed or processing", f.State)
	}
	limit, err := p.limit()
	if err != nil {
		return nil, err
	}
	after, err := decodeCursor("inbox", p.After)
	if err != nil {
		return nil, err
	}
	since, until := f.Received.args()
	var keys []InboxKey
	keys, err = collectInboxKeys(a.db.Query(ctx, a.q.listInbox, f.Consumer, f.Tenant, f.State, f.KeyPrefix,
		since, until, after[0], after[1], after[2], limit+1))
	err = a.wrap(err)
	if err != nil {
		return nil, err
	}
	out := &InboxPage{Keys: nonNil(keys)}
	if len(keys) > limit {
		out.Keys = keys[:limit]
		last := keys[limit-1]
		out.Next = encodeCursor("inbox", last.Consumer, last.Tenant, last.Key)
	}
	return out, nil
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

// EffectPage is one page of effects, in primary key order (tenant, kind, key).
type EffectPage struct {
	Effects []Effect `json:"effects"`
	// Next is the cursor of the next page, empty on the last one.
	Next string `json:"next,omitempty"`
}

var effectStates = []string{"", "pending", "done", "dead", "discarded"}

// ListEffects returns one page of the effects that f picks, in primary key order,
// paged by keyset like ListInbox.
func (a *Admin) ListEffects(ctx context.Context, f EffectFilter, p Page) (*EffectPage, error) {
	if a.shards != nil {
		return a.shardedListEffects(ctx, f, p)
	}
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
	after, err := decodeCursor("effects", p.After)
	if err != nil {
		return nil, err
	}
	since, until := f.Created.args()
	effs, err := a.collectEffects(a.db.Query(ctx, a.q.listEffects, f.Tenant, f.Kind, f.State, f.KeyPrefix, f.Consumer,
		since, until, f.Stuck, a.cfg.StuckAfter, a.cfg.StuckAttempts, after[0], after[1], after[2], limit+1))
	if err != nil {
		return nil, err
	}
	out := &EffectPage{Effects: nonNil(effs)}
	if len(effs) > limit {
		out.Effects = effs[:limit]
		last := effs[limit-1]
		out.Next = encodeCursor("effects", last.Tenant, last.Kind, last.Key)
	}
	return out, nil
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
func (a *Admin) InspectInbox(ctx context.Context, id inbox.ID, o InspectOptions) (*Inspection, error) {
	if a.shards != nil {
		return a.shardedInspectInbox(ctx, id, o)
	}
	if err := id.Validate(); err != nil {
		return nil, err
	}
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
	return out, nil
}

// InspectEffect reads one effect; a missing one is ErrNotFound.
func (a *Admin) InspectEffect(ctx context.Context, id EffectID) (*Effect, error) {
	if a.shards != nil {
		return a.shardedInspectEffect(ctx, id)
	}
	e, err := a.scanEffect(a.db.QueryRow(ctx, a.q.getEffect, id.Tenant, id.Kind, id.Key))
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, errorf(ErrNotFound, "no effect %s", id)
	}
	return e, a.wrap(err)
}

// FindLimit is the most rows of each table Find returns.
const FindLimit = 100

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
// tenant) and (tenant, kind) pair, so it does not scan the tables.
func (a *Admin) Find(ctx context.Context, key string, f FindFilter) (*Found, error) {
	if a.shards != nil {
		return a.shardedFind(ctx, key, f)
	}
	if key == "" {
		return nil, errorf(ErrBadFilter, "find needs a key")
	}
	out := &Found{Key: key}
	var err error
	out.Inbox, err = collectInboxKeys(a.db.Query(ctx, a.q.findInbox, key, f.Tenant, FindLimit))
	err = a.wrap(err)
	if err != nil {
		return nil, err
	}
	out.Effects, err = a.collectEffects(a.db.Query(ctx, a.q.findEffects, key, f.Tenant, f.Kind, FindLimit))
	if err != nil {
		return nil, err
	}
	out.Inbox, out.Effects = nonNil(out.Inbox), nonNil(out.Effects)
	return out, nil
}

func nonNil[T any](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}
