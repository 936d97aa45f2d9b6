package effects

import (
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"fmt"
	"slices"
	"strings"
	"sync"

	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/internal/pgschema"
)

// Item is one effect of a set-based write (EnqueueItems), with the scope it belongs
// to: its tenant and the message that made it.
type Item struct {
	Scope  Scope
	Effect Effect
	// Trace is the span context the effect was enqueued under, kept with the row
	// (see Enqueue). The zero value means the span in EnqueueItems' ctx, if any.
	Trace trace.SpanContext
}

// Buffer collects effects for a set-based write. A group-commit batch of the
// consumer gives each message's handler a Scope with its own Buffer, so that
// Enqueue costs no round trip, and writes the buffers of the whole batch with one
// statement (EnqueueItems) when the handlers are done. A mismatch found then (the
// same tenant, kind and key already stored, or enqueued by another message of the
// batch, with a different payload) fails the message whose effect it is,
// permanently, and rolls back its work; the rest of the batch is run again without
// it. Effects keep the order in which they were added. It is safe for concurrent use.
type Buffer struct {
	mu     sync.Mutex
	items  []Item
	closed bool
}

// NewBuffer returns an empty, open Buffer.
func NewBuffer() *Buffer { return &Buffer{} }

func (b *Buffer) add(scope Scope, e Effect, sc trace.SpanContext) error {
	scope.Buffer = nil
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return ErrBufferClosed
	}
	b.items = append(b.items, Item{Scope: scope, Effect: e, Trace: sc})
	return nil
}

// Close ends the buffer's use and returns what it holds: later Enqueue calls with
// it fail with ErrBufferClosed instead of adding effects nobody would write.
func (b *Buffer) Close() []Item {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.closed = true
	return b.items
}

// EnqueueMany is Enqueue for many effects: with a Buffer in the context's scope it
// adds them all to it (each Result Deferred); otherwise it writes them with one
// statement, as EnqueueItems does. results[i] is effs[i]'s. On error, roll back:
// some of the effects may have been written.
func EnqueueMany(ctx context.Context, tx Tx, effs []Effect) ([]Result, error) {
	scope, _ := ScopeFrom(ctx)
	return EnqueueManyScoped(ctx, tx, scope, effs)
}

// EnqueueManyScoped is EnqueueMany with the scope given explicitly.
func EnqueueManyScoped(ctx context.Context, tx Tx, scope Scope, effs []Effect) ([]Result, error) {
	if tx == nil {
		return nil, ErrNoTx
	}
	if scope.Buffer != nil {
		for i, e := range effs {
			if _, err := checkItem(scope, e); err != nil {
				return nil, &ItemErrors{Errs: itemErr(len(effs), i, err)}
			}
		}
		results := make([]Result, len(effs))
		sc := trace.SpanContextFromContext(ctx)
		for i, e := range effs {
			if err := scope.Buffer.add(scope, e, sc); err != nil {
				return nil, err
			}
			results[i] = Result{Deferred: true}
		}
		return results, nil
	}
	items := make([]Item, len(effs))
	for i, e := range effs {
		items[i] = Item{Scope: scope, Effect: e}
	}
	return EnqueueItems(ctx, tx, items)
}

func itemErr(n, i int, err error) []error {
	errs := make([]error, n)
	errs[i] = err
	return errs
}

// ItemErrors reports which items of a set-based enqueue failed: Errs[i] is items[i]'s
// error, nil for the ones that were written or were duplicates. errors.Is and
// errors.As see every error in it.
type ItemErrors struct {
	Errs []error
}

func (e *ItemErrors) Error() string {
	var parts []string
	for i, err := range e.Errs {
		if err != nil {
			parts = append(parts, fmt.Sprintf("item %d: %v", i, err))
		}
	}
	return "idem: " + strings.Join(parts, "; ")
}

// Unwrap returns the items' errors.
func (e *ItemErrors) Unwrap() []error {
	var out []error
	for _, err := range e.Errs {
		if err != nil {
			out = append(out, err)
		}
	}
	return out
}

// EnqueueItems writes many effects, each with its own scope, in tx with one
// statement: INSERT … SELECT FROM unnest(…) ON CONFLICT DO NOTHING, in (tenant,
// kind, key) order so that two writers that share keys cannot deadlock. Only when
// some effects were not inserted does a second statement read the fingerprints of
// the rows they met. Each effect gets what Enqueue would give it: a Result (with
// Duplicate for the same identity and payload, stored before or earlier in items),
// or ErrFingerprintMismatch. Validation errors come back before anything is written.
// Per-effect errors come back together as an *ItemErrors; the effects without one
// were written (roll back to undo them). All items must name the same schema.
func EnqueueItems(ctx context.Context, tx Tx, items []Item) ([]Result, error) {
	if tx == nil {
		return nil, ErrNoTx
	}
	results := make([]Result, len(items))
	if len(items) == 0 {
		return results, nil
	}
	var schema string
	for i, it := range items {
		s, err := checkItem(it.Scope, it.Effect)
		if err == nil && i > 0 && s != schema {
			err = fmt.Errorf("%w: items name schemas %q and %q; write each schema's effects apart", ErrInvalidSchema, schema, s)
		}
		if err != nil {
			return nil, &ItemErrors{Errs: itemErr(len(items), i, err)}
		}
		schema = s
	}
	q := enqueueQueriesFor(schema)
	ctxTrace := trace.SpanContextFromContext(ctx)

	// One row per identity: the first item that names it is the one written (its
	// writer); the others are duplicates of it or mismatches. Sorting by identity
	// puts each identity's items together, first one first, and gives the order in
	// which the rows are inserted.
	type identity struct{ tenant, kind, key string }
	idOf := func(i int) identity {
		return identity{items[i].Scope.Source.Tenant, items[i].Effect.Kind, items[i].Effect.Key}
	}
	fps := make([][]byte, len(items))
	order := make([]int, len(items))
	for i := range items {
		fp := sha256.Sum256(items[i].Effect.Payload)
		fps[i] = fp[:]
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int {
		x, y := idOf(a), idOf(b)
		return cmp.Or(cmp.Compare(x.tenant, y.tenant), cmp.Compare(x.kind, y.kind), cmp.Compare(x.key, y.key))
	})
	writer := make([]int, len(items)) // each item's writer
	var writers []int
	for j, i := range order {
		if j > 0 && idOf(order[j-1]) == idOf(i) {
			writer[i] = writer[order[j-1]]
			continue
		}
		writer[i] = i
		writers = append(writers, i)
	}

	// stored is the fingerprint each writer's identity holds now, by writer; nil
	// while unknown. inserted says the writer's own row went in.
	stored := make([][]byte, len(items))
	inserted := make([]bool, len(items))
	todo := writers
	for len(todo) > 0 {
		n := len(todo)
		tenants, kinds, keys := make([]string, n), make([]string, n), make([]string, n)
		payloads, fpArr := make([][]byte, n), make([][]byte, n)
		attempts := make([]int32, n)
		delays := make([]int64, n)
		srcC, srcT, srcK := make([]string, n), make([]string, n), make([]string, n)
		traces := make([]string, n)
		for j, i := range todo {
			it := &items[i]
			tenants[j], kinds[j], keys[j] = it.Scope.Source.Tenant, it.Effect.Kind, it.Effect.Key
			payloads[j], fpArr[j] = it.Effect.Payload, fps[i]
			attempts[j] = int32(maxAttemptsOf(it.Effect))
			delays[j] = it.Effect.Delay.Microseconds()
			srcC[j], srcT[j], srcK[j] = it.Scope.Source.Consumer, it.Scope.Source.Tenant, it.Scope.Source.Key
			if it.Trace.IsValid() {
				traces[j] = encodeTrace(it.Trace)
			} else {
				traces[j] = encodeTrace(ctxTrace)
			}
		}
		var count int
		var gotT, gotK, gotY []string
		err := tx.QueryRow(ctx, q.insertMany, tenants, kinds, keys, payloads, fpArr, attempts, delays,
			srcC, srcT, srcK, n, traces).Scan(&count, &gotT, &gotK, &gotY)
		if err != nil {
			return nil, pgschema.Wrap(err, schema)
		}
		if count == n {
			for _, i := range todo {
				inserted[i], stored[i] = true, fps[i]
			}
			break
		}
		byID := make(map[identity]int, n)
		for _, i := range todo {
			byID[idOf(i)] = i
		}
		for j := range gotT {
			if i, ok := byID[identity{gotT[j], gotK[j], gotY[j]}]; ok {
				inserted[i], stored[i] = true, fps[i]
			}
		}
		// The rest met a row: read what it holds (a new statement, a new snapshot).
		var conflictT, conflictK, conflictY []string
		for _, i := range todo {
			if !inserted[i] {
				id := idOf(i)
				conflictT, conflictK, conflictY = append(conflictT, id.tenant), append(conflictK, id.kind), append(conflictY, id.key)
			}
		}
		var haveT, haveK, haveY []string
		var haveFP [][]byte
		if err := tx.QueryRow(ctx, q.fingerprintOf, conflictT, conflictK, conflictY).Scan(&haveT, &haveK, &haveY, &haveFP); err != nil {
			return nil, pgschema.Wrap(err, schema)
		}
		for j := range haveT {
			if i, ok := byID[identity{haveT[j], haveK[j], haveY[j]}]; ok {
				stored[i] = haveFP[j]
			}
		}
		var again []int
		for _, i := range todo {
			if stored[i] == nil {
				again = append(again, i) // deleted in between by the janitor: insert again
			}
		}
		todo = again
	}

	var errs []error
	for i := range items {
		w := writer[i]
		if w == i && inserted[i] {
			continue // written
		}
		id := idOf(i)
		if bytes.Equal(stored[w], fps[i]) {
			results[i] = Result{Duplicate: true}
			continue
		}
		if errs == nil {
			errs = make([]error, len(items))
		}
		if id.tenant != "" {
			errs[i] = fmt.Errorf("%w: tenant %q kind %q key %q", ErrFingerprintMismatch, id.tenant, id.kind, id.key)
		} else {
			errs[i] = fmt.Errorf("%w: kind %q key %q", ErrFingerprintMismatch, id.kind, id.key)
		}
	}
	if errs != nil {
		return results, &ItemErrors{Errs: errs}
	}
	return results, nil
}
