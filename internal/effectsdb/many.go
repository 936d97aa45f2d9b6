package effectsdb

import (
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/internal/pgarray"
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
	// first holds the first item, which is often the only one: no allocation.
	first [1]Item
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
	if b.items == nil {
		b.items = b.first[:0]
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

// EnqueueMany is Enqueue for many effects under one scope: with a Buffer in the
// scope it adds them all to it (each Result Deferred); otherwise it writes them
// with one statement, as EnqueueItems does. results[i] is effs[i]'s. On error, roll
// back: some of the effects may have been written.
func EnqueueMany(ctx context.Context, tx Tx, scope Scope, effs []Effect) ([]Result, error) {
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
//
// On Citus (the items' Scope.Citus) with a tx that pipelines statements (a
// pgx.Tx does), each effect is written by a single-row insert instead, all of
// them and the dispatchers' notification in one round trip, and Citus routes
// each to its tenant's shard (writeEach): Citus runs the INSERT … SELECT through
// the coordinator and commits every such write with two-phase commit, even when
// one worker holds every row; single-row inserts on one worker commit with one
// phase.
func EnqueueItems(ctx context.Context, tx Tx, items []Item) ([]Result, error) {
	if tx == nil {
		return nil, ErrNoTx
	}
	if len(items) == 0 {
		return []Result{}, nil
	}
	schema, err := checkItems(items)
	if err != nil {
		return nil, err
	}
	var w itemsWrite // on the stack: EnqueueItems is a group-commit batch's hot path
	w.plan(items, trace.SpanContextFromContext(ctx))
	q := queriesFor(schema)
	if bt, ok := tx.(batchTx); ok && items[0].Scope.Citus {
		err = w.writeEach(ctx, bt, q)
	} else {
		err = w.write(ctx, tx, q)
	}
	if err != nil {
		return nil, pgschema.Wrap(err, schema)
	}
	return w.results()
}

// batchTx is a Tx that can pipeline statements, as writeEach needs (a pgx.Tx is
// one).
type batchTx interface {
	Tx
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// checkItems validates every item in its scope and returns the one schema they all
// name.
func checkItems(items []Item) (string, error) {
	var schema string
	for i, it := range items {
		s, err := checkItem(it.Scope, it.Effect)
		if err == nil && i > 0 && s != schema {
			err = fmt.Errorf("%w: items name schemas %q and %q; write each schema's effects apart", pgschema.ErrInvalid, schema, s)
		}
		if err != nil {
			return "", &ItemErrors{Errs: itemErr(len(items), i, err)}
		}
		schema = s
	}
	return schema, nil
}

// identity is an effect's identity: one row per identity.
type identity struct{ tenant, kind, key string }

// itemsWrite is one EnqueueItems call: which item writes each identity, and what
// the rounds of inserts learned about each.
type itemsWrite struct {
	items []Item
	// ctxTrace is the span of the call's context, for items without a Trace.
	ctxTrace trace.SpanContext
	// fps holds each item's payload fingerprint.
	fps [][]byte
	// writer is each item's writer: the first item that names its identity, whose
	// row is the one written. The others are duplicates of it or mismatches.
	writer []int
	// writers are the writers, in (tenant, kind, key) order: the insert order.
	writers []int
	// stored is the fingerprint each writer's identity holds now, by writer; nil
	// while unknown. inserted says the writer's own row went in.
	stored   [][]byte
	inserted []bool
	// cols are the insert's columns, filled again for each round.
	cols enqueueColumns
}

// plan fingerprints the items and picks each identity's writer. Sorting by
// identity puts each identity's items together, first one first, and gives the
// order in which the rows are inserted.
func (w *itemsWrite) plan(items []Item, ctxTrace trace.SpanContext) {
	n := len(items)
	*w = itemsWrite{items: items, ctxTrace: ctxTrace, fps: make([][]byte, n), writer: make([]int, n),
		writers: make([]int, 0, n), stored: make([][]byte, n), inserted: make([]bool, n)}
	order := make([]int, n)
	sums := make([]byte, n*sha256.Size) // one allocation for every fingerprint
	for i := range items {
		fp := sums[i*sha256.Size : (i+1)*sha256.Size : (i+1)*sha256.Size]
		h := sha256.Sum256(items[i].Effect.Payload)
		copy(fp, h[:])
		w.fps[i] = fp
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int {
		x, y := w.id(a), w.id(b)
		return cmp.Or(cmp.Compare(x.tenant, y.tenant), cmp.Compare(x.kind, y.kind), cmp.Compare(x.key, y.key))
	})
	for j, i := range order {
		if j > 0 && w.id(order[j-1]) == w.id(i) {
			w.writer[i] = w.writer[order[j-1]]
			continue
		}
		w.writer[i] = i
		w.writers = append(w.writers, i)
	}
}

func (w *itemsWrite) id(i int) identity {
	return identity{w.items[i].Scope.Source.Tenant, w.items[i].Effect.Kind, w.items[i].Effect.Key}
}

// write inserts the writers' rows, and reads the fingerprints of the rows that some
// met instead. A row deleted between the two statements (the janitor) is inserted
// again in the next round.
func (w *itemsWrite) write(ctx context.Context, tx Tx, q *queries) error {
	todo := w.writers
	for len(todo) > 0 {
		w.cols.fill(w, todo)
		var count int
		var gotT, gotK, gotY []string
		sql, args := q.insertMany, w.cols.args()
		if OneTenant(w.cols.tenants) {
			sql, args = q.insertManyOne, append(args, w.cols.tenants[0])
		}
		if err := tx.QueryRow(ctx, sql, args...).Scan(&count, &gotT, &gotK, &gotY); err != nil {
			return err
		}
		if count == len(todo) {
			for _, i := range todo {
				w.inserted[i], w.stored[i] = true, w.fps[i]
			}
			return nil
		}
		byID := make(map[identity]int, len(todo))
		for _, i := range todo {
			byID[w.id(i)] = i
		}
		for j := range gotT {
			if i, ok := byID[identity{gotT[j], gotK[j], gotY[j]}]; ok {
				w.inserted[i], w.stored[i] = true, w.fps[i]
			}
		}
		if err := w.readConflicts(ctx, tx, q, todo, byID); err != nil {
			return err
		}
		var again []int
		for _, i := range todo {
			if w.stored[i] == nil {
				again = append(again, i) // deleted in between by the janitor: insert again
			}
		}
		todo = again
	}
	return nil
}

// writeEach is write with one single-row insert a writer, in one batch (see
// EnqueueItems, on Citus): the same rounds, and the same read of the rows some
// met instead.
func (w *itemsWrite) writeEach(ctx context.Context, tx batchTx, q *queries) error {
	todo := w.writers
	for len(todo) > 0 {
		b := &pgx.Batch{}
		for _, i := range todo {
			it := &w.items[i]
			var src [3]*string
			if it.Scope.Source.Consumer != "" {
				src = [3]*string{&it.Scope.Source.Consumer, &it.Scope.Source.Tenant, &it.Scope.Source.Key}
			}
			tc := w.cols.traceOf(it, w.ctxTrace)
			b.Queue(q.insertRouted, it.Scope.Source.Tenant, it.Effect.Kind, it.Effect.Key, it.Effect.Payload, w.fps[i],
				maxAttemptsOf(it.Effect), it.Effect.Delay, src[0], src[1], src[2], tc)
		}
		// The dispatchers' wake-up, in the same round trip; when every row met
		// one already, it wakes them for nothing, which costs a claim that finds
		// nothing new.
		b.Queue(q.notify)
		br := tx.SendBatch(ctx, b)
		all := true
		for _, i := range todo {
			var ok bool
			err := br.QueryRow().Scan(&ok)
			switch {
			case err == nil:
				w.inserted[i], w.stored[i] = true, w.fps[i]
			case errors.Is(err, pgx.ErrNoRows):
				all = false
			default:
				_ = br.Close()
				return err
			}
		}
		if _, err := br.Exec(); err != nil {
			_ = br.Close()
			return err
		}
		if err := br.Close(); err != nil {
			return err
		}
		if all {
			return nil
		}
		byID := make(map[identity]int, len(todo))
		for _, i := range todo {
			byID[w.id(i)] = i
		}
		if err := w.readConflicts(ctx, tx, q, todo, byID); err != nil {
			return err
		}
		var again []int
		for _, i := range todo {
			if w.stored[i] == nil {
				again = append(again, i) // deleted in between by the janitor: insert again
			}
		}
		todo = again
	}
	return nil
}

// readConflicts reads what the rows that todo's writers met hold (a new statement,
// a new snapshot, which sees rows a concurrent writer committed meanwhile).
func (w *itemsWrite) readConflicts(ctx context.Context, tx Tx, q *queries, todo []int, byID map[identity]int) error {
	var conflictT, conflictK, conflictY []string
	for _, i := range todo {
		if !w.inserted[i] {
			id := w.id(i)
			conflictT, conflictK, conflictY = append(conflictT, id.tenant), append(conflictK, id.kind), append(conflictY, id.key)
		}
	}
	var haveT, haveK, haveY []string
	var haveFP [][]byte
	sql, args := q.fingerprintOf, []any{conflictT, conflictK, conflictY}
	if OneTenant(conflictT) {
		sql, args = q.fingerprintOfOne, append(args, conflictT[0])
	}
	if err := tx.QueryRow(ctx, sql, args...).Scan(&haveT, &haveK, &haveY, &haveFP); err != nil {
		return err
	}
	for j := range haveT {
		if i, ok := byID[identity{haveT[j], haveK[j], haveY[j]}]; ok {
			w.stored[i] = haveFP[j]
		}
	}
	return nil
}

// results says what became of each item: written, a duplicate of what its identity
// holds, or a mismatch.
func (w *itemsWrite) results() ([]Result, error) {
	results := make([]Result, len(w.items))
	var errs []error
	for i := range w.items {
		wr := w.writer[i]
		if wr == i && w.inserted[i] {
			continue // written
		}
		if bytes.Equal(w.stored[wr], w.fps[i]) {
			results[i] = Result{Duplicate: true}
			continue
		}
		if errs == nil {
			errs = make([]error, len(w.items))
		}
		errs[i] = mismatch(w.id(i))
	}
	if errs != nil {
		return results, &ItemErrors{Errs: errs}
	}
	return results, nil
}

// mismatch is ErrFingerprintMismatch for an identity.
func mismatch(id identity) error {
	if id.tenant != "" {
		return fmt.Errorf("%w: tenant %q kind %q key %q", ErrFingerprintMismatch, id.tenant, id.kind, id.key)
	}
	return fmt.Errorf("%w: kind %q key %q", ErrFingerprintMismatch, id.kind, id.key)
}

// enqueueColumns are insertMany's parallel columns, one entry per row to insert.
// A round fills them again, reusing their arrays. attempts, delays and traces
// stay nil (NULL arrays) while every row has the default.
type enqueueColumns struct {
	tenants, kinds, keys   pgarray.Text
	payloads, fingerprints pgarray.Bytea
	attempts               []int32
	delays                 []int64
	srcConsumer, srcKey    pgarray.Text
	traces                 pgarray.Text
	ctxTrace               string
	ctxTraceDone           bool
}

// fill sets the columns to the rows of w's items at idx.
func (c *enqueueColumns) fill(w *itemsWrite, idx []int) {
	n := len(idx)
	c.tenants, c.kinds, c.keys = resize(c.tenants, n), resize(c.kinds, n), resize(c.keys, n)
	c.payloads, c.fingerprints = resize(c.payloads, n), resize(c.fingerprints, n)
	c.srcConsumer, c.srcKey = resize(c.srcConsumer, n), resize(c.srcKey, n)
	c.attempts, c.delays, c.traces = c.attempts[:0], c.delays[:0], c.traces[:0]
	for j, i := range idx {
		it := &w.items[i]
		c.tenants[j], c.kinds[j], c.keys[j] = it.Scope.Source.Tenant, it.Effect.Kind, it.Effect.Key
		c.payloads[j], c.fingerprints[j] = it.Effect.Payload, w.fps[i]
		c.srcConsumer[j], c.srcKey[j] = it.Scope.Source.Consumer, it.Scope.Source.Key
		if a := maxAttemptsOf(it.Effect); a != DefaultMaxAttempts || len(c.attempts) > 0 {
			c.attempts = setAt(c.attempts, n, j, int32(a), DefaultMaxAttempts)
		}
		if d := it.Effect.Delay.Microseconds(); d != 0 || len(c.delays) > 0 {
			c.delays = setAt(c.delays, n, j, d, 0)
		}
		if tc := c.traceOf(it, w.ctxTrace); tc != "" || len(c.traces) > 0 {
			c.traces = setAt(c.traces, n, j, tc, "")
		}
	}
}

// setAt sets s[j] to v, first making s n long with def in every place, when it
// is still empty (every row so far had the default).
func setAt[T any](s []T, n, j int, v, def T) []T {
	if len(s) == 0 {
		s = resize(s, n)
		for k := range s {
			s[k] = def
		}
	}
	s[j] = v
	return s
}

// traceOf is the trace context an item's row keeps: its own span's, or the call's
// (encoded once).
func (c *enqueueColumns) traceOf(it *Item, ctxTrace trace.SpanContext) string {
	if it.Trace.IsValid() {
		return EncodeTrace(it.Trace)
	}
	if !c.ctxTraceDone {
		c.ctxTrace, c.ctxTraceDone = EncodeTrace(ctxTrace), true
	}
	return c.ctxTrace
}

// OneTenant says whether every row's tenant is tenants[0]: then the statements'
// one-tenant forms apply (insertManyOne, fingerprintOfOne, recordOne).
func OneTenant(tenants []string) bool {
	return !slices.ContainsFunc(tenants, func(t string) bool { return t != tenants[0] })
}

// args are insertMany's arguments. The columns left empty go as NULL arrays.
func (c *enqueueColumns) args() []any {
	return []any{c.tenants, c.kinds, c.keys, c.payloads, c.fingerprints, nilIfEmpty(c.attempts), nilIfEmpty(c.delays),
		c.srcConsumer, c.srcKey, len(c.tenants), nilIfEmpty(c.traces)}
}

// nilIfEmpty is s, or nil (a NULL array) when it is empty.
func nilIfEmpty[S ~[]T, T any](s S) S {
	if len(s) == 0 {
		return nil
	}
	return s
}

// resize returns s with length n, reusing its array when it is large enough.
func resize[S ~[]T, T any](s S, n int) S {
	if cap(s) >= n {
		return s[:n]
	}
	return make(S, n)
}
