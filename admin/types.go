package admin

import (
	"encoding/hex"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/inboxdb"
)

// InboxKey is one inbox row: a message's key, or an HTTP request's.
type InboxKey struct {
	Consumer string `json:"consumer"`
	Tenant   string `json:"tenant"`
	Key      string `json:"key"`
	State    string `json:"state"`
	// Fingerprint is the fingerprint of the key's message or request, in
	// lower-case hex.
	Fingerprint string     `json:"fingerprint"`
	Attempts    int        `json:"attempts"`
	ErrorCode   string     `json:"error_code,omitempty"`
	Error       string     `json:"error,omitempty"`
	LeaseUntil  *time.Time `json:"lease_until,omitempty"`
	Fence       int64      `json:"fence,omitempty"`
	ReceivedAt  time.Time  `json:"received_at"`
	CompletedAt *time.Time `json:"completed_at,omitempty"`
	ExpiresAt   time.Time  `json:"expires_at"`
	// Response is the stored answer of an HTTP key (package httpidem); nil for a
	// message's key.
	Response *Response `json:"response,omitempty"`
	// Shard is the shard the row was read on (an Admin over a shard map).
	Shard string `json:"shard,omitempty"`
	// Now is the database's clock when the row was read: compare ages and leases
	// with it, never with the local clock.
	Now time.Time `json:"-"`
}

// ID is the key's identity.
func (k *InboxKey) ID() inbox.ID { return inbox.ID{Consumer: k.Consumer, Tenant: k.Tenant, Key: k.Key} }

// Response describes an HTTP key's stored answer. The body is left out unless it
// was asked for (InspectOptions.Body): it may hold personal data.
type Response struct {
	Status int `json:"status"`
	// Headers are the stored headers (httpidem stores an allow-list of them).
	Headers   map[string][]string `json:"headers"`
	BodyBytes int                 `json:"body_bytes"`
	// BodyRef is the application's reference to the body, when it stored one
	// instead of the body.
	BodyRef string `json:"body_ref,omitempty"`
	// Body is the stored body, only when asked for.
	Body []byte `json:"body,omitempty"`
}

// HeaderNames are the stored headers' names, sorted.
func (r *Response) HeaderNames() []string { return slices.Sorted(maps.Keys(r.Headers)) }

// EffectID is an effect's identity.
type EffectID struct {
	Tenant string `json:"tenant"`
	Kind   string `json:"kind"`
	Key    string `json:"key"`
}

// String is "kind/key", or "tenant:kind/key" for a tenant's effect.
func (id EffectID) String() string {
	if id.Tenant == "" {
		return id.Kind + "/" + id.Key
	}
	return id.Tenant + ":" + id.Kind + "/" + id.Key
}

// Effect is one effect row. The payload is not read, only its size.
type Effect struct {
	Tenant        string     `json:"tenant"`
	Kind          string     `json:"kind"`
	Key           string     `json:"key"`
	State         string     `json:"state"`
	Attempts      int        `json:"attempts"`
	MaxAttempts   int        `json:"max_attempts"`
	InFlight      bool       `json:"in_flight"`
	NextAttemptAt time.Time  `json:"next_attempt_at"`
	CreatedAt     time.Time  `json:"created_at"`
	DoneAt        *time.Time `json:"done_at,omitempty"`
	// LastError is the last failure as the dispatcher stored it: any text at all
	// (a provider's answer, HTML, control characters), to be escaped for display.
	LastError      string `json:"last_error,omitempty"`
	PayloadBytes   int    `json:"payload_bytes"`
	SourceConsumer string `json:"source_consumer,omitempty"`
	SourceTenant   string `json:"source_tenant,omitempty"`
	SourceKey      string `json:"source_key,omitempty"`
	// Stuck says why a pending effect looks stuck, "" when it does not (see
	// Config.StuckAfter and StuckAttempts).
	Stuck string `json:"stuck,omitempty"`
	// Shard is the shard the row was read on (an Admin over a shard map).
	Shard string `json:"shard,omitempty"`
	// Now is the database's clock when the row was read.
	Now time.Time `json:"-"`
}

// ID is the effect's identity.
func (e *Effect) ID() EffectID { return EffectID{Tenant: e.Tenant, Kind: e.Kind, Key: e.Key} }

// Source is the inbox key of the message or request that made the effect, if any.
func (e *Effect) Source() (inbox.ID, bool) {
	return inbox.ID{Consumer: e.SourceConsumer, Tenant: e.SourceTenant, Key: e.SourceKey}, e.SourceConsumer != ""
}

func (a *part) stuckReason(e *Effect) string {
	if e.State != "pending" {
		return ""
	}
	switch {
	case e.InFlight && !e.NextAttemptAt.After(e.Now):
		return fmt.Sprintf("lease ran out %s ago with the outcome unrecorded (its sender stopped); no dispatcher has claimed it since", ago(e.Now.Sub(e.NextAttemptAt)))
	case e.InFlight:
		return fmt.Sprintf("in flight: attempt %d is being sent, its lease ends in %s", e.Attempts, ago(e.NextAttemptAt.Sub(e.Now)))
	case e.Now.Sub(e.NextAttemptAt) > a.cfg.StuckAfter:
		return fmt.Sprintf("due %s ago and not claimed: is a dispatcher sending kind %q?", ago(e.Now.Sub(e.NextAttemptAt)), e.Kind)
	case e.Attempts >= a.cfg.StuckAttempts:
		return fmt.Sprintf("failing: %d of %d attempts made, next in %s", e.Attempts, e.MaxAttempts, ago(e.NextAttemptAt.Sub(e.Now)))
	}
	return ""
}

// ago formats a duration to the second, at least 0s.
func ago(d time.Duration) string {
	return max(d, 0).Round(time.Second).String()
}

// scanInboxKey reads a row of inboxColumns, and then into extra, if given, the
// columns the statement adds after them.
func scanInboxKey(row pgx.Row, extra ...any) (*InboxKey, error) {
	var k InboxKey
	var status *int16
	var header []byte
	var bodyLen *int32
	var ref *string
	var fp []byte
	err := row.Scan(append([]any{&k.Consumer, &k.Tenant, &k.Key, &fp, &k.State, &k.ErrorCode, &k.Error,
		&k.Attempts, &k.LeaseUntil, &k.Fence, &k.ReceivedAt, &k.CompletedAt, &k.ExpiresAt, &k.Now,
		&status, &header, &bodyLen, &ref}, extra...)...)
	if err != nil {
		return nil, err
	}
	k.Fingerprint = hex.EncodeToString(fp)
	if status != nil {
		k.Response = &Response{Status: int(*status), Headers: inboxdb.DecodeHeader(header)}
		if bodyLen != nil {
			k.Response.BodyBytes = int(*bodyLen)
		}
		if ref != nil {
			k.Response.BodyRef = *ref
		}
	}
	return &k, nil
}

func (a *part) scanEffect(row pgx.Row) (*Effect, error) {
	var e Effect
	err := row.Scan(&e.Tenant, &e.Kind, &e.Key, &e.State, &e.Attempts, &e.MaxAttempts, &e.InFlight,
		&e.NextAttemptAt, &e.CreatedAt, &e.DoneAt, &e.LastError, &e.PayloadBytes,
		&e.SourceConsumer, &e.SourceTenant, &e.SourceKey, &e.Now)
	if err != nil {
		return nil, err
	}
	e.Stuck = a.stuckReason(&e)
	e.Shard = a.name
	return &e, nil
}

func (a *part) collectEffects(rows pgx.Rows, err error) ([]Effect, error) {
	if err != nil {
		return nil, a.wrap(err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Effect, error) {
		e, err := a.scanEffect(r)
		if err != nil {
			return Effect{}, err
		}
		return *e, nil
	})
	return out, a.wrap(err)
}

func collectInboxKeys(rows pgx.Rows, err error) ([]InboxKey, error) {
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (InboxKey, error) {
		k, err := scanInboxKey(r)
		if err != nil {
			return InboxKey{}, err
		}
		return *k, nil
	})
}
