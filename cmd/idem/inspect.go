package main

import (
	"context"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/inbox"
)

var inspectCmd = &command{
	name:    "inspect",
	args:    "--consumer C --key K [--tenant T] [flags]",
	summary: "Show one inbox record (state, fingerprint, times, error, stored HTTP response) and the effects it made",
	example: `idem inspect --consumer payments --key pay_789
idem inspect --consumer payments --tenant acme --key pay_789 --json
idem inspect --consumer 'POST /payments' --tenant acct_42 --key 0b6f3c52-7a4e-4d8e-9d0c-4f6a1f7e2b11`,
	setup: func(fs *flag.FlagSet) runFunc {
		var id inbox.ID
		fs.StringVar(&id.Consumer, "consumer", "", "consumer name (required)")
		fs.StringVar(&id.Key, "key", "", "idempotency key (required)")
		fs.StringVar(&id.Tenant, "tenant", "", "tenant scope; empty means none")
		return func(ctx context.Context, e *env, args []string) error {
			return runInspect(ctx, e, args, id)
		}
	},
}

// effectJSON is one effect row in JSON output.
type effectJSON struct {
	Kind           string     `json:"kind"`
	Key            string     `json:"key"`
	State          string     `json:"state"`
	Attempts       int        `json:"attempts"`
	MaxAttempts    int        `json:"max_attempts"`
	NextAttemptAt  time.Time  `json:"next_attempt_at"`
	CreatedAt      time.Time  `json:"created_at"`
	DoneAt         *time.Time `json:"done_at,omitempty"`
	LastError      string     `json:"last_error,omitempty"`
	SourceConsumer string     `json:"source_consumer,omitempty"`
	SourceTenant   string     `json:"source_tenant,omitempty"`
	SourceKey      string     `json:"source_key,omitempty"`
	now            time.Time
}

func scanEffects(rows pgx.Rows) ([]effectJSON, error) {
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (effectJSON, error) {
		var x effectJSON
		err := r.Scan(&x.Kind, &x.Key, &x.State, &x.Attempts, &x.MaxAttempts, &x.NextAttemptAt, &x.CreatedAt,
			&x.DoneAt, &x.LastError, &x.SourceConsumer, &x.SourceTenant, &x.SourceKey, &x.now)
		return x, err
	})
}

type recordJSON struct {
	Consumer    string     `json:"consumer"`
	Tenant      string     `json:"tenant"`
	Key         string     `json:"key"`
	State       string     `json:"state"`
	Fingerprint string     `json:"fingerprint"`
	Attempts    int        `json:"attempts"`
	ErrorCode   string     `json:"error_code,omitempty"`
	Error       string     `json:"error,omitempty"`
	LeaseUntil  *time.Time `json:"lease_until,omitempty"`
	Fence       int64      `json:"fence,omitempty"`
	ReceivedAt  time.Time  `json:"received_at"`
	CompletedAt *time.Time `json:"completed_at,omitempty"`
	ExpiresAt   time.Time  `json:"expires_at"`
	// Response is the stored answer of an HTTP key (package httpidem).
	Response *responseJSON `json:"response,omitempty"`
	Effects  []effectJSON  `json:"effects"`
}

// responseJSON describes a stored HTTP response; the body itself is not shown (it
// may hold personal data), only its size or its reference.
type responseJSON struct {
	Status    int                 `json:"status"`
	Headers   map[string][]string `json:"headers"`
	BodyBytes int                 `json:"body_bytes"`
	BodyRef   string              `json:"body_ref,omitempty"`
}

func runInspect(ctx context.Context, e *env, args []string, id inbox.ID) error {
	if len(args) > 0 {
		return usagef("takes no arguments, got %q", args)
	}
	if id.Consumer == "" || id.Key == "" {
		return usagef("--consumer and --key are required")
	}
	if err := id.Validate(); err != nil {
		return usagef("%v", err)
	}
	pool, err := e.connect(ctx)
	if err != nil {
		return err
	}
	rec, resp, effs, err := inspect(ctx, pool, e.schema, id)
	if errors.Is(err, inbox.ErrNotFound) {
		tenant := ""
		if id.Tenant != "" {
			tenant = fmt.Sprintf(" tenant %q", id.Tenant)
		}
		return fmt.Errorf("no inbox record for consumer %q%s key %q.\n"+
			"Either no delivery of it committed or failed permanently (a transient failure records nothing),\n"+
			"or its retention ended and the janitor deleted it. Check --consumer, --tenant and --key", id.Consumer, tenant, id.Key)
	}
	if err != nil {
		return err
	}
	out := recordJSON{
		Consumer: rec.Consumer, Tenant: rec.Tenant, Key: rec.Key, State: string(rec.State),
		Fingerprint: hex.EncodeToString(rec.Fingerprint), Attempts: rec.Attempts,
		ErrorCode: rec.ErrorCode, Error: rec.Error, LeaseUntil: rec.LeaseUntil, Fence: rec.Fence,
		ReceivedAt: rec.ReceivedAt, CompletedAt: rec.CompletedAt, ExpiresAt: rec.ExpiresAt,
		Effects: nonNil(effs),
	}
	if resp != nil {
		out.Response = &responseJSON{Status: resp.Status, Headers: resp.Header, BodyBytes: len(resp.Body), BodyRef: resp.BodyRef}
	}
	if e.json {
		return e.writeJSON(out)
	}
	tw := e.table("FIELD", "VALUE")
	row(tw, "consumer", rec.Consumer)
	row(tw, "tenant", dash(rec.Tenant))
	row(tw, "key", rec.Key)
	row(tw, "state", rec.State)
	row(tw, "fingerprint", out.Fingerprint)
	row(tw, "attempts", rec.Attempts)
	row(tw, "received_at", ts(&rec.ReceivedAt)+" ("+age(rec.Now.Sub(rec.ReceivedAt))+" ago)")
	row(tw, "completed_at", ts(rec.CompletedAt))
	row(tw, "expires_at", ts(&rec.ExpiresAt)+" (in "+age(rec.ExpiresAt.Sub(rec.Now))+")")
	if rec.State == inbox.StateFailed {
		row(tw, "error_code", dash(rec.ErrorCode))
		row(tw, "error", clip(rec.Error, 200))
	}
	if rec.LeaseUntil != nil {
		row(tw, "lease_until", ts(rec.LeaseUntil))
		row(tw, "fence", rec.Fence)
	}
	if resp != nil {
		body := fmt.Sprintf("%d bytes", len(resp.Body))
		if resp.BodyRef != "" {
			body = "by reference " + resp.BodyRef
		}
		names := slices.Sorted(maps.Keys(resp.Header))
		row(tw, "response", fmt.Sprintf("%d, body %s, headers %s", resp.Status, body, dash(strings.Join(names, ", "))))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(e.stdout, "\nEffects made by this message: %d\n", len(effs))
	if len(effs) == 0 {
		return nil
	}
	return e.effectsTable(effs)
}

// inspect reads one inbox row and its stored HTTP response (nil for a message's
// key), through inbox.Store, and the effects that its message or request made.
func inspect(ctx context.Context, pool *pgxpool.Pool, schema string, id inbox.ID) (*inbox.Record, *inbox.Response, []effectJSON, error) {
	store, err := inbox.NewStore(schema)
	if err != nil {
		return nil, nil, nil, err
	}
	rec, resp, err := store.GetResponse(ctx, pool, id)
	if errors.Is(err, inbox.ErrSchemaMissing) {
		rec, err = store.Get(ctx, pool, id) // a schema from before migration 003: no responses
	}
	if err != nil {
		return nil, nil, nil, err
	}
	rows, err := pool.Query(ctx, newQueries(schema).effectsBySource, id.Consumer, id.Tenant, id.Key)
	if err != nil {
		return nil, nil, nil, err
	}
	effs, err := scanEffects(rows)
	return rec, resp, effs, err
}

// effectsTable prints effects as a table: inspect and effects list share it.
func (e *env) effectsTable(effs []effectJSON) error {
	tw := e.table("KIND", "KEY", "STATE", "ATTEMPTS", "CREATED", "NEXT ATTEMPT / DONE", "LAST ERROR")
	for _, x := range effs {
		when := ts(&x.NextAttemptAt)
		if x.State == "done" {
			when = ts(x.DoneAt)
		} else if x.State == "dead" {
			when = "-"
		}
		row(tw, x.Kind, x.Key, x.State, fmt.Sprintf("%d/%d", x.Attempts, x.MaxAttempts), ts(&x.CreatedAt), when, clip(x.LastError, 60))
	}
	return tw.Flush()
}
